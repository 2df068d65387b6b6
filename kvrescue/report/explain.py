"""`kvrescue report --explain`: what each run did, in words, from its traces: the steps each model committed, the
base cache's size against the budget B, and the detector's stops (the figures a newcomer checks first)."""

from __future__ import annotations

from collections import Counter

from kvrescue.outputs import Trace
from kvrescue.printable import printable
from kvrescue.reasons import DETECTOR_FINISHES, UNDECODED
from kvrescue.report.load import Run
from kvrescue.report.tables import shown
from kvrescue.shapes import BUFFER


def explain(runs: list[Run]) -> list[str]:
    """A few lines per run, in folder order, safe to print (`printable`)."""
    return [printable(line) for run in sorted(runs, key=lambda r: str(r.path)) for line in explain_run(run)]


def counted(n: int, noun: str) -> str:
    """`n` and the noun, plural unless `n` is 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def explain_run(run: Run) -> list[str]:
    """The run's label and accuracy, then one line each on its steps, its base cache and its detector."""
    c, s = run.config, run.summary
    decoded = [t for t in run.traces if t.stop not in UNDECODED]
    steps = [step for t in decoded for step in t.steps]
    helper = sum(step.source == "helper" for step in steps)
    budget = "" if c.budget is None else f" B={c.budget}"
    lines = [f"{shown(run.path)} ({c.method}{budget} N={c.n}): {s.correct}/{s.problems} correct, "
             f"steps scored by {c.scorer}",
             f"  committed {counted(len(steps), 'step')} over {counted(len(decoded), 'problem')}: "
             f"{len(steps) - helper} from the base, "
             f"{helper} from the helper"]
    if "base" in c.models:
        lines.append("  " + cache_line(run, decoded))
    if c.settings.get("detector") is not None:
        lines.append("  " + detector_line(run, decoded))
    return lines


def base_context(trace: Trace) -> int:
    """Tokens the base model's context reached: what it prefilled (prompt, helper steps) plus its own steps."""
    return trace.tokens.base_prefill + sum(step.tokens for step in trace.steps if step.source == "base")


def cache_line(run: Run, decoded: list[Trace]) -> str:
    """The base cache's size after each commit and at its peak against the context it stood for, and B' = B + W for
    an evicted one."""
    context = max(map(base_context, decoded), default=0)
    peak = max((t.peak_base_rows for t in decoded), default=0)
    held = max((step.base_rows or 0 for t in decoded for step in t.steps), default=0)
    budget = run.config.budget
    sizes = f"at most {held} entries after a commit (peak {peak}) for a context of up to {context} tokens"
    if budget is None:
        return f"base cache: full, {sizes}"
    bound = budget + (run.config.settings.get("buffer") or BUFFER)
    over = sum(base_context(t) >= bound for t in decoded)
    return (f"base cache ({run.config.evictor}): {sizes}; compressed to B = {budget} each time it reached "
            f"B' = {bound} (in {over} of {len(decoded)} problems the context reached B')")


def detector_line(run: Run, decoded: list[Trace]) -> str:
    """How many base candidates the detector stopped, by test, and where the first stop was (or how close it came)."""
    tau = run.config.settings["detector"]
    base = [(t.idx, k, cand) for t in decoded for k, cands in enumerate(t.candidates) for cand in cands
            if cand.source == "base"]
    stopped = [(idx, k, cand) for idx, k, cand in base if cand.finish in DETECTOR_FINISHES]
    if not stopped:
        ents = [cand.max_mean_entropy for _, _, cand in base if cand.max_mean_entropy is not None]
        rhos = [cand.min_gzip_ratio for _, _, cand in base if cand.min_gzip_ratio is not None]
        closest = (f"highest mean entropy {max(ents):.2f} (fires > {tau['tau_ent']})" if ents else "no entropy seen",
                   f"lowest gzip ratio {min(rhos):.3f} (fires < {tau['tau_cmp']})" if rhos
                   else f"no candidate reached {tau['cmp_chars']} characters for the gzip test")
        return f"detector: stopped none of {len(base)} base candidates; {closest[0]}, {closest[1]}"
    reasons = Counter(cand.finish for _, _, cand in stopped)
    idx, k, cand = stopped[0]
    value = (f"mean entropy {cand.max_mean_entropy:.2f} > {tau['tau_ent']}" if cand.finish == "entropy"
             else f"gzip ratio {cand.min_gzip_ratio:.3f} < {tau['tau_cmp']} over its last {tau['cmp_chars']} "
             "characters")
    return (f"detector: stopped {len(stopped)} of {len(base)} base candidates ("
            + ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
            + f"); the first: problem {idx}, step {k + 1}, at token {cand.fired_at} ({value})")

"""Step generation on a real loaded checkpoint whose weights are set to follow a bigram script."""

import math

import pytest
import torch

from kvrescue.detect import DetectorConfig, gzip_ratio
from kvrescue.engine import FullCache, load_model
from kvrescue.engine.runner import Runner
from kvrescue.engine.sampling import SamplingParams, sample
from kvrescue.engine import step_table as step_table_module
from kvrescue.engine.step_table import StepTable, step_table
from kvrescue.engine.steps import StepRules
from tests.oracles import Detector, generate_steps

pytestmark = pytest.mark.usefixtures("kernel_layouts")  # each test also under CUDA's kernel layouts

GREEDY = SamplingParams(temperature=0)


def _scripted(folder, script: dict[int, int]):
    """Load the checkpoint and make token t always predict script[t] (attention and MLP outputs zeroed)."""
    m = load_model(folder)
    with torch.no_grad():
        for layer in m.net.decoder.layers:
            layer.attention.wo.weight.zero_()
            layer.feed_forward.w2.weight.zero_()
        emb, head = m.net.decoder.tok_embeddings.weight, m.net.head.weight
        emb.zero_()
        head.zero_()
        for slot, (t, nxt) in enumerate(script.items()):
            emb[t, slot] = 1.0
            head[nxt, slot] = 10.0
    return m


@pytest.fixture(scope="module")
def tok(qwen2_dir):
    return load_model(qwen2_dir).tokenizer


def _ids(tok, *words):
    out = []
    for w in words:
        ids = tok.encode(w)
        assert len(ids) == 1, w
        out.append(ids[0])
    return out


def _run(m, prompts, screened=None, **kw):
    runner = Runner(m, FullCache.for_model(m.net, 8192, max_rows=32, block_size=8))
    rows = runner.prefill(prompts)
    rules = StepRules(frozenset(m.eos_ids), kw.pop("params", GREEDY), **kw)
    res = generate_steps(runner, rows, [(0, i, 0, 0) for i in range(len(rows))], rules, screened)
    return res, runner.cache, rows


@pytest.fixture(params=["table", "text"])
def step_rule(request, tok, monkeypatch):
    """Step ends read from the token-id table, or (a tokenizer that can't be tabled) from decoded text."""
    if request.param == "text":
        monkeypatch.setattr(StepTable, "_concatenates", staticmethod(lambda *args: False))
        monkeypatch.setattr(step_table_module, "_TABLES", {})
        with pytest.warns(UserWarning, match="checked on decoded text"):
            assert not step_table(tok).exact
    return request.param


@pytest.mark.filterwarnings("ignore:.*checked on decoded text")
def test_stops_at_delimiter_eos_and_cap_independently(qwen2_dir, tok, step_rule) -> None:
    step, ans, x, nl, dot, is_ = _ids(tok, "Step", " answer", " x", "\n", ".", " is")
    eos = tok.eos_token_id
    # Row 0: Step -> answer -> \n -> \n (delimiter across two tokens). Row 1: x -> . -> EOS.
    # Row 2: is -> is -> ... (hits the cap). Row 3: a prompt ending in \n, then \n \n.
    script = {step: ans, ans: nl, nl: nl, x: dot, dot: eos, is_: is_}
    m = _scripted(qwen2_dir, script)
    res, cache, rows = _run(m, [[1, step], [5, 6, x], [is_], [nl]], max_step_tokens=6)
    assert [r.finish for r in res] == ["step", "eos", "length", "step"]
    assert res[0].tokens == [ans, nl, nl] and res[0].text == " answer\n\n"
    assert res[1].tokens == [dot, eos]
    assert len(res[2].tokens) == 6
    assert res[3].tokens == [nl, nl] and res[3].text == "\n\n"  # the prompt's \n is not part of the step
    for r in res:
        assert r.text == tok.decode(r.tokens)
        assert len(r.entropies) == len(r.tokens) and all(h < 1e-3 for h in r.entropies)
    # Each row's cache holds its step except the last token.
    assert [cache.length(r) for r in rows] == [2 + 2, 3 + 1, 1 + 5, 1 + 1]


@pytest.mark.filterwarnings("ignore:.*checked on decoded text")
def test_step_delimiter_is_found_in_decoded_text_only(qwen2_dir, tok, step_rule) -> None:
    """A \\n, a word, then \\n: no delimiter; text equals the decoding of multi-byte characters too."""
    nl, the = _ids(tok, "\n", " the")
    e1, e2 = tok.encode("é")
    script = {the: nl, nl: e1, e1: e2, e2: nl}  # " the" "\n" "é" "\n" "é" ... never two newlines in a row
    m = _scripted(qwen2_dir, script)
    res, _, _ = _run(m, [[the]], max_step_tokens=9)
    assert res[0].finish == "length"
    assert "\n\n" not in res[0].text and res[0].text == tok.decode(res[0].tokens) and "é" in res[0].text


def test_context_cap_and_the_detector_screens_every_token_the_last_one_too(qwen2_dir, tok) -> None:
    (is_,) = _ids(tok, " is")
    eos = tok.eos_token_id
    m = _scripted(qwen2_dir, {is_: is_})
    res, _, _ = _run(m, [[is_] * 10], max_context=14)
    assert res[0].finish == "length" and len(res[0].tokens) == 4
    # A window of 3 characters: gzip makes it about 8 times longer, so tau 10 fires at once.
    screen = DetectorConfig(cmp_chars=3, tau_cmp=10.0, min_tokens=1000)
    res, _, _ = _run(m, [[is_], [is_]], screened=[False, True], max_step_tokens=8, detector=screen)
    assert res[0].finish == "length" and res[0].min_gzip_ratio is None and res[0].max_mean_entropy is None
    assert res[1].finish == "repetition" and res[1].fired_at == 1 == len(res[1].tokens)
    # The step's last token (EOS here) is screened too: it is missing from no extreme, and can drop it.
    m = _scripted(qwen2_dir, {is_: eos})
    calm = DetectorConfig(min_tokens=1, ent_window=1)
    res, _, _ = _run(m, [[is_]], screened=[True], detector=calm)
    assert res[0].finish == "eos" and res[0].max_mean_entropy is not None
    res, _, _ = _run(m, [[is_]], screened=[True], detector=DetectorConfig(min_tokens=1, tau_ent=-1.0))
    assert res[0].finish == "entropy" and res[0].fired_at == 1


def _agrees_with_the_oracle(tokenizer, r, config: DetectorConfig) -> None:
    """The decode loop's finish, firing position and extremes equal the per-token oracle fed the same tokens."""
    det = Detector(config)
    reason, text = None, ""
    for i, (token, h) in enumerate(zip(r.tokens, r.entropies)):
        piece = tokenizer.decode(r.tokens[: i + 1]).rstrip("\ufffd")[len(text):]
        text += piece
        reason = det.update(piece, h)
        if reason:
            break
    assert (reason or r.finish) == r.finish and (det.fired_at if reason else None) == r.fired_at
    assert det.max_mean_entropy == pytest.approx(r.max_mean_entropy, abs=1e-9) if det.max_mean_entropy else r.max_mean_entropy is None
    assert det.min_gzip_ratio == r.min_gzip_ratio


def test_vectorised_detector_matches_the_per_token_reference(qwen2_dir) -> None:
    """Sampled steps screened on the device: finish, max mean entropy and min ratio equal `Detector` fed token by token."""
    m = load_model(qwen2_dir)
    config = DetectorConfig(tau_ent=5.85, ent_window=4, min_tokens=6, tau_cmp=1.12, cmp_chars=40)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    res, _, _ = _run(m, [m.tokenizer.encode("Step 1: Let x be")] * 6, screened=[True] * 6, params=params,
                     max_step_tokens=60, detector=config)
    assert {"entropy", "repetition", "length"} <= {r.finish for r in res}
    for r in res:
        _agrees_with_the_oracle(m.tokenizer, r, config)


def test_the_entropy_mean_before_the_window_fills_is_over_the_tokens_seen(qwen2_dir) -> None:
    """With --ent-min-tokens 3 below --ent-window 12, the mean at token 3 is over 3 entropies, not 12: a threshold
    just under every token's entropy fires at token 3 on the decode loop (dividing by the window: about token 12)."""
    m = load_model(qwen2_dir)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    prompts = [m.tokenizer.encode("Step 1: Let x be")] * 4
    quiet = DetectorConfig(tau_ent=float("inf"), ent_window=12, min_tokens=3, tau_cmp=float("-inf"))
    seen, _, _ = _run(m, prompts, screened=[True] * 4, params=params, max_step_tokens=16, detector=quiet)
    lowest = min(h for r in seen for h in r.entropies[:12])
    config = DetectorConfig(tau_ent=lowest - 1e-3, ent_window=12, min_tokens=3, tau_cmp=float("-inf"))
    res, _, _ = _run(m, prompts, screened=[True] * 4, params=params, max_step_tokens=16, detector=config)
    assert [(r.finish, r.fired_at) for r in res] == [("entropy", 3)] * 4
    for r, first in zip(res, seen):
        assert r.max_mean_entropy == pytest.approx(sum(first.entropies[:3]) / 3, abs=1e-9)
        _agrees_with_the_oracle(m.tokenizer, r, config)


# -- the detector's precedence and eligibility edges, on the decode loop (a one-character token repeated: the
# text holds n characters after n tokens, and every token has the same entropy) ----------------------------------
K = 8  # min_tokens: the first token the entropy test applies to
OFF = dict(tau_ent=float("inf"), tau_cmp=float("-inf"))


@pytest.fixture(scope="module")
def repeat(qwen2_dir, tok):
    (x,) = _ids(tok, "x")
    return _scripted(qwen2_dir, {x: x}), x


def _screened(m, prompt: list[int], config: DetectorConfig, max_step_tokens: int = 40):
    (r,), _, _ = _run(m, [prompt], screened=[True], max_step_tokens=max_step_tokens, detector=config)
    _agrees_with_the_oracle(m.tokenizer, r, config)
    return r


@pytest.mark.parametrize("cmp_chars, finish, at", [(K, "entropy", K), (K - 3, "repetition", K - 3),
                                                    (K + 3, "entropy", K)])
def test_entropy_wins_when_both_tests_fire_on_one_token(repeat, cmp_chars, finish, at) -> None:
    m, x = repeat
    # tau_ent -1 fires at the first token the entropy test applies to, tau_cmp 10 at the first the gzip test does
    config = DetectorConfig(tau_ent=-1.0, ent_window=4, min_tokens=K, tau_cmp=10.0, cmp_chars=cmp_chars)
    r = _screened(m, [x], config)
    assert (r.finish, r.fired_at, len(r.tokens)) == (finish, at, at)


def test_each_threshold_does_not_fire_at_equality_and_fires_just_past_it(repeat) -> None:
    m, x = repeat
    window = dict(ent_window=4, min_tokens=K, cmp_chars=K + 4)
    calm = _screened(m, [x], DetectorConfig(**window, **OFF))
    assert calm.finish == "length" and calm.min_gzip_ratio == gzip_ratio("x" * (K + 4))
    mean, ratio = calm.max_mean_entropy, calm.min_gzip_ratio  # every checked position has these values
    at = _screened(m, [x], DetectorConfig(**window, tau_ent=mean, tau_cmp=ratio))
    assert at.finish == "length" and (at.max_mean_entropy, at.min_gzip_ratio) == (mean, ratio)
    ent = _screened(m, [x], DetectorConfig(**window, tau_ent=math.nextafter(mean, -math.inf), tau_cmp=ratio))
    assert (ent.finish, ent.fired_at) == ("entropy", K)  # the first eligible token
    cmp = _screened(m, [x], DetectorConfig(**window, tau_ent=mean, tau_cmp=math.nextafter(ratio, math.inf)))
    assert (cmp.finish, cmp.fired_at) == ("repetition", K + 4)  # the first token with cmp_chars characters


def test_the_last_token_of_a_step_is_screened_whatever_ended_it(qwen2_dir, tok, repeat) -> None:
    m, x = repeat
    for config, finish in ((DetectorConfig(tau_ent=-1.0, min_tokens=K, **{"tau_cmp": OFF["tau_cmp"]}), "entropy"),
                           (DetectorConfig(cmp_chars=K, tau_cmp=10.0, **{"tau_ent": OFF["tau_ent"]}), "repetition")):
        r = _screened(m, [x], config, max_step_tokens=K)  # the length cap's token is the first eligible one
        assert (r.finish, r.fired_at, len(r.tokens)) == (finish, K, K)
    (nl,) = _ids(tok, "\n")
    ends = _scripted(qwen2_dir, {x: nl, nl: nl})  # "\n" "\n": the delimiter ends the step at its second token
    for config, finish in ((DetectorConfig(tau_ent=-1.0, min_tokens=2, ent_window=1, tau_cmp=OFF["tau_cmp"]), "entropy"),
                           (DetectorConfig(cmp_chars=2, tau_cmp=100.0, tau_ent=OFF["tau_ent"]), "repetition")):
        r = _screened(ends, [x], config)
        assert (r.finish, r.fired_at, r.tokens) == (finish, 2, [nl, nl])
    assert _screened(ends, [x], DetectorConfig(min_tokens=2, ent_window=1, **OFF)).finish == "step"


def test_a_two_byte_character_at_the_window_boundary(qwen2_dir, tok) -> None:
    """"é" is two byte tokens: with a window of 8 characters (the paper's 800 follow the same rule at 100 times the
    tokens), after 15 tokens the text holds 7 characters and half of one (not text yet), so the gzip test first
    applies at token 16, to 8 characters (16 bytes)."""
    e1, e2 = tok.encode("é")
    m = _scripted(qwen2_dir, {e1: e2, e2: e1})
    ratio = gzip_ratio("é" * 8)
    config = DetectorConfig(tau_cmp=math.nextafter(ratio, math.inf), cmp_chars=8)
    r = _screened(m, [e2], config, max_step_tokens=40)
    assert (r.finish, r.fired_at, r.min_gzip_ratio) == ("repetition", 16, ratio)
    assert r.text == "é" * 8
    r = _screened(m, [e2], DetectorConfig(tau_cmp=100.0, cmp_chars=8), max_step_tokens=40)  # the first eligible token
    assert (r.finish, r.fired_at, r.min_gzip_ratio) == ("repetition", 16, ratio)


def test_sampled_steps_reproducible_and_batch_independent(qwen2_dir) -> None:
    m = load_model(qwen2_dir)
    prompt = m.tokenizer.encode("Step 1: Let x be the number")
    rules = StepRules(frozenset(m.eos_ids), SamplingParams(temperature=1.0, top_k=50, top_p=0.95), max_step_tokens=12)
    runner = Runner(m, FullCache.for_model(m.net, 8192, max_rows=32, block_size=8))
    (parent,) = runner.prefill([prompt])
    keys = [(3, 0, 0, c) for c in range(4)]
    rows = runner.fork(parent, 4)
    together = generate_steps(runner, rows, keys, rules)
    runner.release(rows)
    for c in (2, 0):
        (row,) = runner.fork(parent, 1)
        alone = generate_steps(runner, [row], keys[c : c + 1], rules)
        runner.release([row])
        assert alone[0].tokens == together[c].tokens
        assert alone[0].text == together[c].text
        assert max(abs(a - b) for a, b in zip(alone[0].entropies, together[c].entropies)) < 1e-4
    assert len({tuple(r.tokens) for r in together}) > 1


@pytest.mark.parametrize("fixed_length", [None, 5])
def test_a_step_draws_what_its_streams_give_token_by_token(qwen2_dir, fixed_length) -> None:
    """A step's uniforms are tabled when it starts (`StepDecoder`): its tokens are those `sample` draws from each
    stream key and counter token by token (counters 0, 1, ...) on the same row's logits."""
    m = load_model(qwen2_dir)
    prompt = m.tokenizer.encode("Step 1: Let x be the number")
    params = SamplingParams(temperature=1.2, top_k=0, top_p=1.0)  # many tokens in play: a wrong draw shows
    rules = StepRules(frozenset(), params, max_step_tokens=9, fixed_length=fixed_length)
    keys = [(7, 2, 1, c) for c in range(3)]
    runner = Runner(m, FullCache.for_model(m.net, 8192, max_rows=32, block_size=8))
    (parent,) = runner.prefill([prompt])
    steps = generate_steps(runner, runner.fork(parent, 3), keys, rules)
    assert [len(s.tokens) for s in steps] == [fixed_length or 9] * 3
    for key, step in zip(keys, steps):
        cache = FullCache.for_model(m.net, 8192, max_rows=2, block_size=8)
        row = cache.create()
        with torch.inference_mode():
            logits = m.net.prefill(torch.tensor([prompt]), cache, [row], [len(prompt)])
            for counter, token in enumerate(step.tokens):
                assert sample(logits.float(), [key], [counter], params)[0].item() == token
                logits = m.net.decode(torch.tensor([token]), cache, [row])


def test_steps_prepared_before_they_advance_are_the_steps_advanced_alone(qwen2_dir) -> None:
    """`Runner.prepare` (the sampling launched, its copy to the host started) before each `advance` decodes the same
    tokens, entropies and ends as `advance` alone; a step opened while a launched token is unread is refused."""
    model = load_model(qwen2_dir)
    rules = StepRules(frozenset(model.eos_ids), SamplingParams(), max_step_tokens=12)
    results = []
    for prepared in (False, True):
        runner = Runner(model, FullCache.for_model(model.net, 4096, max_rows=32))
        rows = runner.fork(runner.prefill([[5, 6, 7] * 3])[0], 4)
        runner.start(rows, [(0, i, 0, 0) for i in range(4)], [9] * 4, [True] * 4, rules)
        if prepared:
            runner.prepare()
            with pytest.raises(RuntimeError, match="not yet read"):
                runner.start(rows[:1], [(0, 9, 0, 0)], [9], [True], rules)
        done = []
        while runner.busy:
            if prepared:
                runner.prepare()
                runner.prepare()  # a second launch before the advance does nothing
            done += runner.advance()
        results.append(sorted((s.row, s.tokens, s.entropies, s.finish) for s in done))
    assert results[0] == results[1] and len(results[0]) == 4

"""`kvrescue report`: the paper's tables and Figure 5 from run folders.

Every number is computed from traces with `outputs.summarize` (summary.json is not trusted, only used
to tell finished runs from running or interrupted ones). Conventions:
- A *row* aggregates the seeds of one configuration (bench, method, evictor, N, budget, models,
  scorer); its value is the mean over seeds of each run's number, with the population standard deviation
  (n in the denominator, the paper's ±) where there are two seeds or more.
- Accuracy is the paper's Table 5 metric, "is_correct ∧ \\boxed" (graded correct and the output holds a `\\boxed`);
  the grader's verdict alone (which also reads "the answer is" and the last number) is a second table.
- Runs still in progress (no summary.json, fewer problems than selected, or traces newer than the
  summary) are included and marked with `*`.
- Recovery = (A_kvrescue - A_bon) / (A_full - A_bon), A the paper's accuracy, for the same bench, N, budget, evictor
  and base model (full: same bench, N and base model); it is n/a, with the reason, when one is missing. Its average
  (the paper's "87% at B = 64") is per evictor and budget, over benches, base models and N, and per base model.
- Degeneration: incorrect trajectories with >= 256 committed steps over all problems (Table 2's numbers), and over
  the incorrect ones (Table 2's caption). Base tokens: the mean over benches of each one's change (Table 1's -43%),
  and the pooled change.
- Throughput: problems per minute after the first problem finished (Table 3's steady state).
- Oracle-of-two: per seed present in both, a problem counts correct when `bon` (N = 1) or `helper`
  (N = 1) solved it, over the problems both recorded; the share of the eviction loss it recovers is
  (A_oracle - A_bon) / (A_full - A_bon) with `full` at N = 1.
- Over seeds (configurations with two seeds or more): avg@n, unbiased pass@k and maj@k over the problems every
  seed recorded (`report.seeds`).
"""

from kvrescue.report.load import FolderNote, ReportError, Run, load_runs
from kvrescue.report.numbers import QUANTILES, Table
from kvrescue.report.render import fmt, header, plot, plot_image, print_rich, to_csv, to_json, to_latex, to_markdown
from kvrescue.report.tables import build_tables, shown

__all__ = ["QUANTILES", "FolderNote", "ReportError", "Run", "Table", "build_tables", "fmt", "header", "load_runs", "plot",
           "plot_image", "print_rich", "shown", "to_csv", "to_json", "to_latex", "to_markdown"]

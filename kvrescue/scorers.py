"""The step scorers a run names with --prm: a PRM checkpoint, or the named alternative scorer (torch-free, for the
grid, the planner and `kvrescue cost`)."""

PRM = "prm"  # the `prm` role's checkpoint scores each step (engine/prm.PRMScorer, vllm_engine/prm.VLLMPRMScorer)
HELPER_LOGLIK = "helper-loglik"  # the helper's mean token log-probability (engine/scoring.HelperLoglik)
SCORERS = (PRM, HELPER_LOGLIK)

"""Why a candidate step ended (its finish) and why a problem's decoding stopped (its stop): the one vocabulary of
both, as the engines report them and the run folder records them (`kvrescue.outputs` documents each)."""

STEP, EOS, LENGTH, ENTROPY, REPETITION = "step", "eos", "length", "entropy", "repetition"
NONFINITE = "non-finite"  # the model's logits held a NaN or +inf: nothing can be sampled (a finish, and a stop)
FINISHES = (STEP, EOS, LENGTH, ENTROPY, REPETITION, NONFINITE)
DETECTOR_FINISHES = (ENTROPY, REPETITION)  # the detector fired: the candidate is dropped, not scored

CONTEXT, STEPS, SKIPPED, FAILED = "context", "steps", "skipped", "failed"
STOPS = (EOS, CONTEXT, STEPS, SKIPPED, FAILED, NONFINITE)
UNDECODED = (SKIPPED, FAILED)  # stops of problems that were not decoded

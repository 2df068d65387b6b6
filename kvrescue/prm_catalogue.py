"""The PRM recipes and the qwen-math recipe's input formats by name, torch-free: the grid checks `--prm-recipe` and
`--prm-format` against them before anything is loaded. The recipes themselves (`engine/prm_recipes/`, one per file)
are registered against the same names."""

PRM_RECIPES = ("qwen-math", "rlhflow", "math-shepherd", "skywork")  # --prm-recipe (besides `auto`)
PRM_FORMATS = ("paper", "model-card")  # --prm-format: the qwen-math recipe's inputs (engine/prm_recipes/qwen_math.py)
# The recipes whose committed step's piece differs from its candidate's (RLHFlow's carries its "+" label where a
# candidate has the hole): the PRM feeds each of their committed steps with the next candidates, where it otherwise
# keeps the winning candidate's K/V (engine/prm.py; the memory planner counts the feed).
REFEEDS = ("rlhflow",)

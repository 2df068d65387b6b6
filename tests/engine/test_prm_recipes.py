"""The PRM recipe registry (engine/prm_recipes): each non-Qwen recipe against its model card's procedure
(tests/prm_cards.py) on a random checkpoint of its architecture: the whole trajectory's token ids and score
positions exactly, and the engine's PRMScorer (prefix cached, candidates as suffixes) within 1e-4 in fp32 of the
card run through transformers; the choice of a recipe and its one-line errors."""

import shutil

import orjson
import pytest

from kvrescue.group_models import load_roles
from kvrescue.engine import load_model
from kvrescue.engine.loader import ModelLoadError, tensor_names
from kvrescue.engine.prm import PRMScorer, check_prm
from kvrescue.engine.prm_recipes import FORMATS, OTHERS, get_recipe
from kvrescue.engine.prm_recipes.choose import auto_recipe, weight_names
from kvrescue.prm_catalogue import PRM_FORMATS, PRM_RECIPES, REFEEDS
from kvrescue.auto_options import resolve_prm_recipe
from kvrescue.errors import InputError
from kvrescue.grid import GridOptions
from kvrescue.model_config import load_config
from kvrescue_testkit.random_checkpoints import write_random_checkpoint
from kvrescue.search import SearchSettings
from tests.conftest import TINY
from tests.helpers import small_grid
from tests.oracles import prm_last_scores, prm_scores, trajectory_ids
from tests.prm_cards import CARDS

PROBLEM = "What is 3x + 5 = 20 for x?"
# The policy's steps as generated (each but the last ends in the "\n\n" delimiter); one holds a single "\n" (two
# parts to Skywork's reference), one ends in the policy's end of text.
STEPS = ["Step 1: 3x = 15.\n\n", "Dividing both sides by 3.\nx = 5.\n\n", "The answer is \\boxed{5}.<|im_end|>"]
CLEAN = ["Step 1: 3x = 15.", "Dividing both sides by 3.\nx = 5.", "The answer is \\boxed{5}."]
WRONG = "A wrong turn: x = 7.\n\n"
NEW = ["rlhflow", "math-shepherd", "skywork"]


@pytest.fixture
def folder(request, rlhflow_dir, math_shepherd_dir, skywork_dir):
    return {"rlhflow": rlhflow_dir, "math-shepherd": math_shepherd_dir, "skywork": skywork_dir}[request.param]


def _prm(folder):
    return load_model(folder, "float32")


@pytest.mark.parametrize("folder, name", [(n, n) for n in NEW], indirect=["folder"])
def test_the_whole_trajectory_s_ids_and_score_positions_are_the_card_s(folder, name) -> None:
    prm = _prm(folder)
    card_ids, card_positions = CARDS[name][0](prm.tokenizer, PROBLEM, CLEAN)
    ids, ends = trajectory_ids(check_prm(prm, get_recipe(name)), PROBLEM, STEPS)
    assert ids == card_ids
    assert ends == card_positions and len(ends) == 3
    # and the scorer's inputs: each candidate's suffix after its problem's cached prefix is the card's input up to
    # that step's score position
    scorer = PRMScorer(prm, max_problems=1, max_candidates=4, recipe=get_recipe(name))
    scorer.open(0, PROBLEM)
    sent = []
    candidates = scorer.inputs.candidates
    scorer.inputs.candidates = lambda requests: sent.append(candidates(requests)) or sent[-1]
    for t, step in enumerate(STEPS):
        scorer.score([(0, step, []), (0, WRONG, [])])
        assert scorer.inputs.problems[0].prefix() + sent[-1][0] == card_ids[: card_positions[t] + 1]
        wrong_ids, wrong_positions = CARDS[name][0](prm.tokenizer, PROBLEM, CLEAN[:t] + [WRONG.strip()])
        assert scorer.inputs.problems[0].prefix() + sent[-1][1] == wrong_ids[: wrong_positions[-1] + 1]
        scorer.commit(0, step)
        codec = scorer.inputs.codec
        assert (name in REFEEDS) == (codec.committed(step, t) != codec.candidates([step], [t])[0])
    assert scorer.inputs.problems[0].prefix() == card_ids


@pytest.mark.usefixtures("kernel_layouts")  # also under CUDA's kernel layouts
@pytest.mark.parametrize("folder, name", [(n, n) for n in NEW], indirect=["folder"])
def test_the_scorer_s_scores_are_the_card_s_through_transformers(folder, name) -> None:
    prm = _prm(folder)
    recipe = get_recipe(name)
    scorer = PRMScorer(prm, max_problems=2, max_candidates=8, recipe=recipe)
    for key in (0, 1):
        scorer.open(key, PROBLEM)
    card = CARDS[name][1]
    for t, step in enumerate(STEPS):
        requests = [(k, text, []) for k in (0, 1) for text in (step, WRONG)]
        got = scorer.score(requests)
        want = [card(folder, PROBLEM, CLEAN[: t + 1])[-1], card(folder, PROBLEM, CLEAN[:t] + [WRONG.strip()])[-1]]
        assert got == pytest.approx(want * 2, abs=1e-4)
        assert got[0] != pytest.approx(got[1], abs=1e-6)  # the candidates are told apart
        for k in (0, 1):
            scorer.commit(k, step)
    whole = card(folder, PROBLEM, CLEAN)
    assert prm_scores(prm, PROBLEM, STEPS, recipe=recipe) == pytest.approx(whole, abs=1e-4)
    last = prm_last_scores(prm, PROBLEM, [STEPS[:1], STEPS], recipe=recipe)
    assert last == pytest.approx([card(folder, PROBLEM, CLEAN[:1])[-1], whole[-1]], abs=1e-4)
    assert scorer.close(0)[1] == 0 and scorer.close(1)[1] == 0
    assert scorer.cache.blocks_in_use() == 0


def test_the_recipe_is_chosen_from_the_checkpoint(rlhflow_dir, math_shepherd_dir, skywork_dir, prm_dir,
                                                  qwen2_dir) -> None:
    def auto(folder) -> str | None:
        return auto_recipe(str(folder), load_config(str(folder)), weight_names(str(folder)))

    assert [auto(f) for f in (rlhflow_dir, math_shepherd_dir, skywork_dir, prm_dir)] == NEW + ["qwen-math"]
    assert auto(qwen2_dir) is None  # a Qwen2 LM: no PRM head, and no LM-head recipe of its architecture
    assert auto_recipe("RLHFlow/Llama3.1-8B-PRM-Deepseek-Data", {}, set()) == "rlhflow"  # a Hub id offline: its name
    assert auto_recipe("peiyi9979/math-shepherd-mistral-7b-prm", {}, set()) == "math-shepherd"
    assert auto_recipe("Skywork/Skywork-o1-Open-PRM-Qwen-2.5-1.5B", {}, set()) == "skywork"
    assert auto_recipe("Qwen/Qwen2.5-Math-PRM-7B", {}, set()) == "qwen-math"
    assert auto_recipe("some/prm", {}, set()) == "qwen-math"  # nothing known: the default (the loader speaks next)


def test_the_head_weights_are_read_as_the_loader_reads_them(skywork_dir, prm_dir, tmp_path) -> None:
    """`weight_names` is the loader's `tensor_names`: the headers of the safetensors files; a folder whose weights the
    loader cannot read has none, and the loader's error follows."""
    names = tensor_names(skywork_dir)
    assert weight_names(str(skywork_dir)) == names and {"v_head.summary.weight", "model.embed_tokens.weight"} <= names
    broken = _copy(prm_dir, tmp_path / "broken")
    next((tmp_path / "broken").glob("*.safetensors")).write_bytes(b"\x08" + b"\0" * 7 + b"{")
    assert weight_names(broken) == set() and weight_names("Qwen/Qwen2.5-Math-PRM-7B") == set()
    with pytest.raises(ModelLoadError, match="is not a readable safetensors file"):
        tensor_names(broken)


def test_a_skywork_folder_of_pytorch_weight_files_scores_as_its_safetensors_one(skywork_dir, tmp_path) -> None:
    """Skywork's Hub repos ship pytorch_model.bin: a folder of PyTorch weight files (sharded here) is read as the
    safetensors one (the recipe chosen from its head, the same scores exactly), and identified by its weights."""
    import torch
    from safetensors.torch import load_file

    from kvrescue.model_config import model_revision

    def bin_copy(to, scale=1.0):
        folder = _copy(skywork_dir, tmp_path / to)
        tensors = load_file(f"{folder}/model.safetensors")
        names = sorted(tensors)
        for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
            torch.save({k: tensors[k] * (scale if k == "v_head.summary.bias" else 1) for k in part},
                       f"{folder}/pytorch_model-0000{i + 1}-of-00002.bin")
        (tmp_path / to / "model.safetensors").unlink()
        return folder

    folder = bin_copy("bin")
    assert tensor_names(folder) == tensor_names(skywork_dir)
    assert auto_recipe(folder, load_config(folder), weight_names(folder)) == "skywork"
    recipe = get_recipe("skywork")
    assert prm_scores(_prm(folder), PROBLEM, STEPS, recipe=recipe) == prm_scores(_prm(skywork_dir), PROBLEM, STEPS,
                                                                                 recipe=recipe)
    assert model_revision(folder) not in (model_revision(bin_copy("other", scale=2.0)), model_revision(str(skywork_dir)))


def _copy(folder, to, **config):
    """A copy of a checkpoint folder at `to`, its config.json updated with `config`."""
    shutil.copytree(folder, to)
    cfg = orjson.loads((to / "config.json").read_bytes()) | config
    (to / "config.json").write_bytes(orjson.dumps(cfg))
    return str(to)


def test_a_language_model_is_a_recipe_s_only_where_its_name_or_config_says(rlhflow_dir, math_shepherd_dir, llama_dir,
                                                                           tmp_path) -> None:
    """An LM-head checkpoint is RLHFlow's or Math-Shepherd's by its name (a Hub id, its folder's own name) or the
    `_name_or_path` of its config; a plain Llama or Mistral is refused in one line naming the recipes and
    --prm-recipe, even below a folder whose name would say."""
    plain = [str(llama_dir), _copy(rlhflow_dir, tmp_path / "llama-3.1-8b"), _copy(math_shepherd_dir, tmp_path / "m7b"),
             _copy(math_shepherd_dir, tmp_path / "math-shepherd-runs" / "mistral")]
    for model in plain:
        assert auto_recipe(model, load_config(model), weight_names(model)) is None, model
        with pytest.raises(InputError, match=r"^--prm .* has no PRM head .* neither its name nor its config says which "
                                             r"PRM it is \(a (llama|mistral) model\): give --prm-recipe, one of "
                                             r"qwen-math, rlhflow, math-shepherd, skywork, or --prm helper-loglik"):
            _recipe(model, prm_recipe="auto")
    named = {_copy(rlhflow_dir, tmp_path / "Llama3.1-8B-PRM-Deepseek-Data"): "rlhflow",
             _copy(rlhflow_dir, tmp_path / "a", _name_or_path="RLHFlow/Llama3.1-8B-PRM-Mistral-Data"): "rlhflow",
             _copy(math_shepherd_dir, tmp_path / "b", _name_or_path="peiyi9979/math-shepherd-mistral-7b-prm"):
                 "math-shepherd"}
    for model, recipe in named.items():
        assert _recipe(model, prm_recipe="auto") == recipe, model
    assert _recipe(plain[1], prm_recipe="rlhflow") == "rlhflow"  # given: as given


def _options(prm: str, **kw) -> GridOptions:
    given = {"models": {"base": "b", "helper": "h", "prm": prm}, "settings": SearchSettings(batch=8)} | kw
    return small_grid(None, **given)


def _recipe(prm: str, **kw) -> str:
    """The recipe `run` resolves for the grid of `_options(prm, **kw)`."""
    return resolve_prm_recipe(_options(prm, **kw).group_plan())


def test_resolution_and_its_one_line_errors(skywork_dir, prm_dir, qwen2_dir) -> None:
    assert _recipe(str(skywork_dir), prm_recipe="auto") == "skywork"
    assert _recipe(str(prm_dir), prm_recipe="auto") == "qwen-math"
    assert _recipe(str(qwen2_dir), prm_recipe="rlhflow") == "rlhflow"  # as given
    with pytest.raises(InputError, match="no PRM head .* give --prm-recipe, one of qwen-math, rlhflow, "
                                         "math-shepherd, skywork"):
        _recipe(str(qwen2_dir), prm_recipe="auto")
    with pytest.raises(InputError) as e:  # vLLM 0.32 has no value-head PRM: --engine vllm says so
        _recipe(str(skywork_dir), prm_recipe="skywork", engine="vllm")
    assert str(e.value) == ("--engine vllm: vLLM 0.32 has no value-head PRM (Skywork's v_head.summary on a Qwen2 "
                            "decoder; its Qwen2 reward models carry a two-layer score head), so the skywork recipe "
                            "runs on --engine native only")
    for name in ("qwen-math", "rlhflow", "math-shepherd"):  # served by vLLM (tests/vllm_engine/test_prm.py)
        assert _recipe(str(prm_dir), prm_recipe=name, engine="vllm") == name
    with pytest.raises(InputError, match="unknown --prm-recipe 'chat': use one of auto, qwen-math, rlhflow"):
        _options(str(prm_dir), prm_recipe="chat").check()
    with pytest.raises(ValueError, match="unknown PRM recipe 'chat': use one of " + ", ".join(PRM_RECIPES)):
        get_recipe("chat")
    assert get_recipe("qwen-math", "model-card") is FORMATS["model-card"]


def test_a_checkpoint_without_the_recipe_s_head_or_window_is_refused(rlhflow_dir, skywork_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="has a language-model head, but the skywork recipe reads a value head"):
        PRMScorer(_prm(rlhflow_dir), recipe=get_recipe("skywork"))
    with pytest.raises(ValueError, match="no process-reward head"):
        PRMScorer(_prm(skywork_dir), recipe=FORMATS["paper"])
    narrow = write_random_checkpoint(tmp_path / "narrow", "math-shepherd", seed=8, sliding_window=64, **TINY)
    with pytest.raises(ValueError, match="sliding_window of 64 tokens would matter for the 4096 tokens"):
        PRMScorer(_prm(narrow), recipe=get_recipe("math-shepherd"))
    assert PRMScorer(_prm(narrow), recipe=get_recipe("math-shepherd"), window=64).inputs.window == 64
    with pytest.raises(InputError, match="base model .*: its sliding_window of 64 tokens would matter for the 320"):
        load_roles(_options(str(skywork_dir), models={"base": str(narrow), "helper": "h", "prm": str(skywork_dir)},
                            settings=SearchSettings(batch=8, context_cap=320)).group_plan(), "cpu")



def test_the_registry_holds_a_recipe_for_each_name_of_the_catalogue() -> None:
    """One list of names: `--prm-recipe` and `--prm-format` are checked against the torch-free catalogue, and each of
    its names has its recipe (qwen-math one per format), no other."""
    assert tuple(FORMATS) == PRM_FORMATS and {recipe.name for recipe in FORMATS.values()} == {"qwen-math"}
    assert set(PRM_RECIPES) == {"qwen-math", *OTHERS} and len(PRM_RECIPES) == len(OTHERS) + 1
    assert [get_recipe(name, fmt).name for name in PRM_RECIPES for fmt in PRM_FORMATS] == [
        name for name in PRM_RECIPES for _ in PRM_FORMATS]

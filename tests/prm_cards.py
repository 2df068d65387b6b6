"""The PRMs' model-card procedures, transcribed as the tests' independent references (no engine code): each gives
a trajectory's token ids, the positions its scores are read at, and its scores through Hugging Face transformers.

Sources: RLHFlow's and Math-Shepherd's from huggingface/search-and-learn src/sal/models/reward_models.py
(`RLHFFlow._score_single`, after RLHFlow's prm_evaluate.py; the Math-Shepherd model card's snippet); Skywork's from
src/sal/models/skywork_o1_prm/{io_utils,prm_model}.py (`prepare_input`, `derive_step_rewards`, `ValueHead`).
A trajectory is given as the policy's steps without their "\\n\\n" delimiters.
"""

from itertools import accumulate

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM, MistralForCausalLM, Qwen2Model


# -- RLHFlow/Llama3.1-8B-PRM-Deepseek-Data ---------------------------------------------------------------------
def rlhflow_conversation(question: str, ans: str) -> list[dict[str, str]]:
    conversation = []
    ans_list = ans.split("\n\n")
    for k in range(len(ans_list)):
        text = question + " " + ans_list[0] if k == 0 else ans_list[k]
        conversation.append({"content": text, "role": "user"})
        conversation.append({"content": "+", "role": "assistant"})
    return conversation


def rlhflow_ids(tokenizer, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
    """The whole conversation's ids, and each step's score position: -3 in the conversation up to its reply."""
    conversation = rlhflow_conversation(question, "\n\n".join(steps))
    ids = tokenizer.apply_chat_template(conversation, return_dict=False)
    positions = [len(tokenizer.apply_chat_template(conversation[: 2 * k + 2], return_dict=False)) - 3
                 for k in range(len(steps))]
    return ids, positions


def rlhflow_scores(folder, question: str, steps: list[str]) -> list[float]:
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    candidate_tokens = [tokenizer.encode("+")[-1], tokenizer.encode("-")[-1]]
    conversation = rlhflow_conversation(question, "\n\n".join(steps))
    scores = []
    for k in range(len(steps)):
        input_ids = tokenizer.apply_chat_template(conversation[: 2 * k + 2], return_tensors="pt", return_dict=False)
        with torch.no_grad():
            logits = model(input_ids).logits[:, -3, candidate_tokens]
        scores.append(logits.softmax(dim=-1)[:, 0][0].item())
    return scores


# -- peiyi9979/math-shepherd-mistral-7b-prm ---------------------------------------------------------------------
def math_shepherd_input(tokenizer, question: str, steps: list[str]) -> list[int]:
    output = "\n".join(step + " ки" for step in steps)
    return tokenizer.encode(f"{question} {output}")


def math_shepherd_ids(tokenizer, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
    ids = math_shepherd_input(tokenizer, question, steps)
    step_tag_id = tokenizer.encode("ки")[-1]
    return ids, [i for i, t in enumerate(ids) if t == step_tag_id]


def math_shepherd_scores(folder, question: str, steps: list[str]) -> list[float]:
    model = MistralForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    candidate_tokens = tokenizer.encode("+ -")[1:]
    step_tag_id = tokenizer.encode("ки")[-1]
    input_id = torch.tensor([math_shepherd_input(tokenizer, question, steps)])
    with torch.no_grad():
        logits = model(input_id).logits[:, :, candidate_tokens]
        scores = logits.softmax(dim=-1)[:, :, 0]
    return scores[input_id == step_tag_id].tolist()


# -- Skywork-o1-Open-PRM-Qwen-2.5 -----------------------------------------------------------------------------
def skywork_prepare_input(problem: str, response: str, tokenizer, step_token: str = "\n"):
    prompt_ids = tokenizer.encode(tokenizer.bos_token + problem + "\n")
    response_ids = []
    reward_flags = [0] * len(prompt_ids)
    step_token_id = tokenizer.encode(step_token)[-1]
    for step in response.split(step_token):
        step_ids = tokenizer.encode(step) if step != "" else []
        step_ids += [step_token_id]
        flag = [0] * len(step_ids)
        flag[-1] = 1
        response_ids.extend(step_ids)
        reward_flags.extend(flag)
    return prompt_ids + response_ids, reward_flags


def skywork_ids(tokenizer, problem: str, steps: list[str]) -> tuple[list[int], list[int]]:
    """The reference's ids of the response "\\n".join(steps), and each step's score position: the last reward flag
    among its parts (a step holding a "\\n" is several parts to the reference)."""
    ids, flags = skywork_prepare_input(problem, "\n".join(steps), tokenizer)
    flagged = [i for i, f in enumerate(flags) if f]
    ends = accumulate(len(s.split("\n")) for s in steps)
    return ids, [flagged[e - 1] for e in ends]


def skywork_scores(folder, problem: str, steps: list[str]) -> list[float]:
    """sigmoid(v_head(last hidden state)) at each step's position: Qwen2Model's hidden states (after the final norm,
    as the reference's hidden_states[-1]) and the value head Linear read from the checkpoint."""
    body = Qwen2Model.from_pretrained(folder, dtype=torch.float32).eval()
    weights = load_file(folder / "model.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids, positions = skywork_ids(tokenizer, problem, steps)
    with torch.no_grad():
        h = body(torch.tensor([ids])).last_hidden_state[0]
        value = h @ weights["v_head.summary.weight"].T + weights["v_head.summary.bias"]
    return torch.sigmoid(value[positions, 0]).tolist()


CARDS = {
    "rlhflow": (rlhflow_ids, rlhflow_scores),
    "math-shepherd": (math_shepherd_ids, math_shepherd_scores),
    "skywork": (skywork_ids, skywork_scores),
}

"""Step generation on a real loaded checkpoint whose weights are set to follow a bigram script."""

import pytest
import torch

from kvrescue_cli.engine import FullCache, load_model
from kvrescue_cli.engine.sampling import SamplingParams
from kvrescue_cli.engine.steps import StepText, append_tokens, generate_steps

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


def _run(m, prompts, **kw):
    cache = FullCache.for_model(m.net, 8192, max_rows=32, block_size=8)
    rows = [cache.create() for _ in prompts]
    logits = append_tokens(m, cache, rows, prompts)
    res = generate_steps(m, cache, rows, logits, [(0, i, 0, 0) for i in range(len(rows))], kw.pop("params", GREEDY), **kw)
    return res, cache, rows


def test_stops_at_delimiter_eos_and_cap_independently(qwen2_dir, tok) -> None:
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


def test_step_delimiter_is_found_in_decoded_text_only(qwen2_dir, tok) -> None:
    """A \\n, a word, then \\n: no delimiter; text equals the decoding of multi-byte characters too."""
    nl, the = _ids(tok, "\n", " the")
    e1, e2 = tok.encode("é")
    script = {the: nl, nl: e1, e1: e2, e2: nl}  # " the" "\n" "é" "\n" "é" ... never two newlines in a row
    m = _scripted(qwen2_dir, script)
    res, _, _ = _run(m, [[the]], max_step_tokens=9)
    assert res[0].finish == "length"
    assert "\n\n" not in res[0].text and res[0].text == tok.decode(res[0].tokens) and "é" in res[0].text


def test_context_cap_and_callback(qwen2_dir, tok) -> None:
    (is_,) = _ids(tok, " is")
    m = _scripted(qwen2_dir, {is_: is_})
    res, _, _ = _run(m, [[is_] * 10], max_context=14)
    assert res[0].finish == "length" and len(res[0].tokens) == 4
    seen = []

    def cb(i: int, text: str, h: float) -> str | None:
        seen.append((i, text))
        return "repetition" if i == 1 and len(seen) >= 5 else None

    res, _, _ = _run(m, [[is_], [is_]], callback=cb, max_step_tokens=8)
    assert res[0].finish == "length" and res[1].finish == "repetition"
    assert len(res[1].tokens) == 3 and all(t == " is" for _, t in seen)


def test_sampled_steps_reproducible_and_batch_independent(qwen2_dir) -> None:
    m = load_model(qwen2_dir)
    prompt = m.tokenizer.encode("Step 1: Let x be the number")
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95)
    cache = FullCache.for_model(m.net, 8192, max_rows=32, block_size=8)
    parent = cache.create()
    logits = append_tokens(m, cache, [parent], [prompt])
    keys = [(3, 0, 0, c) for c in range(4)]
    rows = cache.fork(parent, 4)
    together = generate_steps(m, cache, rows, logits.expand(4, -1), keys, params, max_step_tokens=12)
    cache.release(rows)
    for c in (2, 0):
        (row,) = cache.fork(parent, 1)
        alone = generate_steps(m, cache, [row], logits, keys[c : c + 1], params, max_step_tokens=12)
        cache.release([row])
        assert alone[0].tokens == together[c].tokens
        assert alone[0].text == together[c].text
        assert max(abs(a - b) for a, b in zip(alone[0].entropies, together[c].entropies)) < 1e-4
    assert len({tuple(r.tokens) for r in together}) > 1


def test_step_text_pieces_concatenate_to_the_decoding(tok) -> None:
    text = "Step 1: é = 5.\n\nthe answer is 5"
    st = StepText(tok)
    pieces = [st.push(t) for t in tok.encode(text)]
    assert "".join(pieces) == text == st.text

"""ds_mp.tools.evaluate on hand-checkable fakes, plus a tiny real GPT-2 against HF's own loss."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ds_mp.tools.evaluate import (cloze_accuracy, cloze_predictions, eval_cli, hf_logits_fn,
                            load_jsonl_texts, perplexity, sliding_window_nll)

V = 11


class CountingModel:
    """Fake LM over ids 0..V-1 for the sequence x_t = t mod V.

    At input position j it puts probability q(j + 1) on the true next id (x_j + 1) mod V,
    where j + 1 is the context length it saw, and spreads the rest uniformly. Calls are
    recorded as (first id, length).
    """

    def __init__(self, q=lambda c: 0.5):
        self.q, self.calls = q, []

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        assert ids.shape[0] == 1
        T = ids.shape[1]
        self.calls.append((int(ids[0, 0]), T))
        probs = torch.empty(T, V, dtype=torch.float64)
        for j in range(T):
            q = self.q(j + 1)
            probs[j] = (1 - q) / (V - 1)
            probs[j, (int(ids[0, j]) + 1) % V] = q
        return probs.log().unsqueeze(0)                # logits = log-probs


def counting_tokens(n: int) -> torch.Tensor:
    return torch.arange(n) % V


def test_uniform_model_ppl_is_vocab_size():
    uniform = lambda ids: torch.zeros(1, ids.shape[1], V)
    for window, stride in [(5, 5), (8, 3), (100, 100)]:
        assert perplexity(uniform, counting_tokens(23), window, stride) == pytest.approx(V)


@pytest.mark.parametrize("window, stride", [(4, 4), (6, 6), (4, 2), (8, 3), (8, 1), (50, 50)])
def test_prob_p_on_true_token_gives_ppl_1_over_p(window, stride):
    model = CountingModel(q=lambda c: 0.25)
    total, scored = sliding_window_nll(model, counting_tokens(30), window, stride)
    assert scored == 29                                # every token but the first, once
    assert total == pytest.approx(29 * -math.log(0.25))
    assert perplexity(model, counting_tokens(30), window, stride) == pytest.approx(4.0)
    assert all(T <= window for _, T in model.calls)


def test_each_token_scored_once_with_hand_contexts():
    # N = 10, window = 4, stride = 2 (module docstring): windows score targets
    #   [1, 5) from x[0:4] with contexts 1,2,3,4; [5, 7) from x[2:6]: contexts 3,4;
    #   [7, 9) from x[4:8]: contexts 3,4;     [9, 10) from x[5:9] (end-aligned): context 4
    q = {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}
    model = CountingModel(q=lambda c: q[c])
    total, scored = sliding_window_nll(model, counting_tokens(10), window=4, stride=2)
    contexts = [1, 2, 3, 4, 3, 4, 3, 4, 4]
    assert scored == 9
    assert total == pytest.approx(sum(-math.log(q[c]) for c in contexts))
    assert model.calls == [(0, 4), (2, 4), (4, 4), (5, 4)]


def test_non_overlapping_windows_lose_no_token():
    # stride == window: window k feeds x[4k : 4k+4] and scores x[4k+1 .. 4k+4]
    model = CountingModel(q=lambda c: 0.5 if c == 1 else 0.9)
    total, scored = sliding_window_nll(model, counting_tokens(13), window=4, stride=4)
    assert scored == 12 and model.calls == [(0, 4), (4, 4), (8, 4)]
    assert total == pytest.approx(3 * (-math.log(0.5) - 3 * math.log(0.9)))


def test_original_token_count_normalisation():
    model = CountingModel(q=lambda c: 0.25)
    total, scored = sliding_window_nll(model, counting_tokens(21), 8, 4)
    ppl = perplexity(model, counting_tokens(21), 8, 4, original_token_count=15)
    assert ppl == pytest.approx(math.exp(total / 15)) and ppl == pytest.approx(4.0 ** (20 / 15))


def test_bad_arguments():
    model = CountingModel()
    with pytest.raises(ValueError, match="stride"):
        sliding_window_nll(model, counting_tokens(10), window=4, stride=5)
    with pytest.raises(ValueError, match="at least 2"):
        sliding_window_nll(model, counting_tokens(1), window=4, stride=4)


# ----------------------------------------------------------------------------- cloze
class PieceTokenizer:
    """Greedy longest-match tokenizer over a fixed list of pieces."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            best = max((k for k, p in enumerate(self.pieces) if text.startswith(p, i)),
                       key=lambda k: len(self.pieces[k]))
            ids.append(best)
            i += len(self.pieces[best])
        return ids


PIECES = ["the", " big", " c", "at", "ow", " d", "og", " sat"]
BIGRAM = {"the": " big", " big": " c", " c": "at", " d": "at", "at": " sat", "ow": " sat",
          "og": " sat", " sat": "the"}   # the fake model's greedy next piece given the last one


def bigram_model(ids: torch.Tensor) -> torch.Tensor:
    logits = torch.zeros(1, ids.shape[1], len(PIECES))
    for j, i in enumerate(ids[0].tolist()):
        logits[0, j, PIECES.index(BIGRAM[PIECES[i]])] = 5.0
    return logits


def test_cloze_rule_all_sub_tokens_must_be_right():
    tok = PieceTokenizer(PIECES)
    examples = [
        "the big cat",   # target " c"+"at": both greedy predictions right -> correct
        "the big cow",   # " c" right, "ow" predicted as "at" -> wrong
        "the big dat",   # " d" wrong (model says " c"), "at" right under teacher forcing -> wrong
        "the big cat sat",  # single-piece target " sat" after "at" -> correct
    ]
    assert tok.encode(" cow") == [2, 4]
    assert cloze_predictions(bigram_model, tok, examples) == [True, False, False, True]
    assert cloze_accuracy(bigram_model, tok, examples) == pytest.approx(0.5)
    # context cut from the left to fit max_len: "big c" still predicts "at"
    assert cloze_predictions(bigram_model, tok, ["the big cat"], max_len=2) == [True]


def test_load_jsonl_texts(tmp_path):
    path = tmp_path / "lambada.jsonl"
    path.write_text(json.dumps({"text": "the big cat"}) + "\n\n" + json.dumps({"text": "a b"}) + "\n")
    assert load_jsonl_texts(path) == ["the big cat", "a b"]


# ----------------------------------------------------------------------------- real GPT-2
def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=101, n_positions=64,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def test_full_window_matches_hf_loss():
    model = tiny_gpt2()
    tokens = torch.randint(0, 101, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf_loss = model(input_ids=tokens[None], labels=tokens[None]).loss.item()
    fn = hf_logits_fn(model)
    assert perplexity(fn, tokens, window=37, stride=37) == pytest.approx(math.exp(hf_loss), rel=1e-5)
    total, scored = sliding_window_nll(fn, tokens, window=64, stride=10)   # window > N: one pass
    assert scored == 36 and total / scored == pytest.approx(hf_loss, rel=1e-5)
    total, scored = sliding_window_nll(fn, tokens, window=12, stride=5)    # overlapping
    assert scored == 36 and math.isfinite(total)


def test_eval_cli_end_to_end(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "the", "big", "cat", "sat", "on", "a", "mat", "dog", "ran"]
    wl = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model_dir = tmp_path / "model"
    tiny_gpt2().save_pretrained(model_dir)
    PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="[UNK]").save_pretrained(model_dir)
    text = tmp_path / "wiki.txt"
    text.write_text("the big cat sat on a mat the dog ran on the mat " * 4)
    cloze = tmp_path / "lambada.jsonl"
    cloze.write_text("\n".join(json.dumps({"text": t}) for t in ["the cat sat", "a dog ran"]))

    rc = eval_cli(["--model", str(model_dir), "--data", str(text), "--window", "16",
                   "--stride", "8", "--original-tokens", "auto", "--cloze", str(cloze),
                   "--device", "cpu"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])   # libraries may log first
    assert rc == 0
    assert out["tokens"] == 52 and out["scored_tokens"] == 51 and out["original_tokens"] == 52
    assert out["ppl"] == pytest.approx(math.exp(out["nll"]))
    assert out["ppl_original"] == pytest.approx(math.exp(out["nll"] * 51 / 52))
    assert out["cloze_examples"] == 2 and 0.0 <= out["accuracy"] <= 1.0
    assert eval_cli(["--model", str(model_dir)]) == 2            # nothing to evaluate

    import numpy as np
    np.save(tmp_path / "tokens.npy", np.arange(40, dtype=np.uint16) % 101)
    rc = eval_cli(["--model", str(model_dir), "--data", str(tmp_path / "tokens.npy"),
                   "--max-tokens", "30", "--original-tokens", "20", "--device", "cpu"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["tokens"] == 30 and out["window"] == 64 and out["stride"] == 64
    assert out["ppl_original"] == pytest.approx(math.exp(out["nll"] * 29 / 20))

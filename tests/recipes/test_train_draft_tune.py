"""The draft recipe's tune stage (recipes/train_draft.py --tune-from): an exported draft, its output
layer widened, distilled further and exported again.

Widening keeps every row the draft had (its logits for its own ids do not move) and adds the
ids the data counts most that it lacks, their rows starting as the target's embedding rows.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

import train_draft  # noqa: E402

from tests.small_drafts import moved_small_draft  # noqa: E402

VOCAB = torch.arange(0, 49152, 96)  # [512]: every 96th id


def small_draft():
    return moved_small_draft(VOCAB)


def counts_favouring(ids: list[int]) -> torch.Tensor:
    """[V] counts: every id once, VOCAB's ids and then `ids` far more, in that order."""
    counts = torch.ones(49152, dtype=torch.long)
    counts[VOCAB] = 10_000
    for rank, token in enumerate(ids):
        counts[token] = 1_000 - rank
    return counts


def test_widening_keeps_the_drafts_rows_and_adds_the_most_counted_ids_it_lacks():
    draft = small_draft()
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(1))  # [2, 24]
    with torch.no_grad():
        before = draft(input_ids=ids).logits  # [2, 24, V]
    favoured = [5, 49151, 777, 1]  # none a multiple of 96
    vocab = train_draft.widen_vocab(draft, counts_favouring(favoured), 515)
    assert vocab.tolist() == sorted(VOCAB.tolist() + favoured[:3])
    assert torch.equal(draft.lm_head.token_ids, vocab) and draft.config.draft_vocab_size == 515
    with torch.no_grad():
        after = draft(input_ids=ids).logits  # [2, 24, V]
        torch.testing.assert_close(after[..., VOCAB], before[..., VOCAB], rtol=0, atol=1e-5)
        assert torch.isfinite(after[..., favoured[:3]]).all() and torch.isinf(after[..., favoured[3]]).all()
        rows = dict(zip(vocab.tolist(), draft.lm_head.weight))
        for token in favoured[:3]:
            assert torch.equal(rows[token], draft.model.embed_tokens.weight[token])


def test_widening_to_fewer_ids_than_the_draft_has_is_refused():
    with pytest.raises(ValueError, match="narrow"):
        train_draft.widen_vocab(small_draft(), counts_favouring([]), 500)


def fake_rows(count: int, length: int, k: int = 4) -> list[dict]:
    """Rows shaped as generate writes them: ids, and the target's top-k ids and log-probs at each position."""
    generator = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(count):
        ids = torch.randint(0, 49152, (length,), generator=generator).tolist()
        top_ids = torch.randint(0, 49152, (length, k), generator=generator).int()  # [length, k]
        top_logprobs = torch.log_softmax(torch.randn(length, k, generator=generator), -1).half()  # [length, k]
        rows.append({"prompt_ids": ids[:6], "generated_ids": ids[6:], "top_ids": top_ids, "top_logprobs": top_logprobs})
    return rows


def test_token_counts_count_each_positions_top_id_and_each_emitted_id():
    rows = fake_rows(3, 9)
    expected = torch.zeros(49152, dtype=torch.long)
    for row in rows:
        for token in row["top_ids"][:, 0].tolist() + row["generated_ids"]:
            expected[token] += 1
    counts = train_draft.token_counts(rows)
    assert counts.shape == (49152,) and torch.equal(counts, expected) and int(counts.sum()) == 3 * 9 + 3 * 3


def test_training_without_shards_says_to_generate_first(tmp_path):
    with pytest.raises(SystemExit, match="run the generate stage"):
        train_draft.load_rows(tmp_path)


def test_tuning_trains_the_exported_draft_on_this_folders_data_and_exports_it_widened(tmp_path):
    from specd.engine.loading import load_causal_lm

    start, out = tmp_path / "start", tmp_path / "out"
    draft = small_draft()
    train_draft.stage_export(SimpleNamespace(out=start), draft)  # config, own weights, the tokenizer's files
    rows = fake_rows(4, 20)
    args = SimpleNamespace(tune_from=start, draft_vocab=600, work=tmp_path, out=out, seed=7, tune_steps=2, tune_lr=1e-3,
                           warmup=1, threads=1, device="cpu", batch=2, seq=16, log_every=1, save_every=1)
    tuned = train_draft.stage_tune(args, rows)
    assert (tmp_path / "tuned.ckpt").exists() and torch.load(tmp_path / "tuned.ckpt")["step"] == 2
    train_draft.stage_export(args, tuned)
    loaded = load_causal_lm(str(out)).model
    assert loaded.config.draft_vocab_size == 600 and set(VOCAB.tolist()) <= set(loaded.lm_head.token_ids.tolist())
    # The training moved the draft's own layer and left the borrowed ones as the target's (checked on
    # the tuned draft itself: a loaded one takes its borrowed layers from the target whatever training did).
    assert not torch.equal(loaded.model.layers[2].mlp.up_proj.weight, draft.model.layers[2].mlp.up_proj.weight.to(torch.bfloat16).float())
    assert torch.equal(tuned.model.layers[0].mlp.up_proj.weight, draft.model.layers[0].mlp.up_proj.weight)


def test_distilling_on_fewer_rows_than_a_batch_says_so(tmp_path):
    args = SimpleNamespace(tune_from=None, batch=8, threads=1, device="cpu")
    with pytest.raises(SystemExit, match="3 rows in --work's shards, fewer than one batch"):
        train_draft.distill(args, small_draft(), fake_rows(3, 10), VOCAB, tmp_path / "tuned.ckpt", 2, 1e-3, batch_seed=1)


def test_tuning_refuses_the_vocab_stage(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_draft.main(["vocab", "--work", str(tmp_path), "--tune-from", str(tmp_path / "draft")])
    assert "--tune-from takes the draft's own vocabulary" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any stage ran


def test_growing_an_exported_draft_deepens_it_and_distills_it_on_this_folders_data(tmp_path):
    """`train --tune-from D --grow-layers L --grow-steps N`: D widened, grown by len(L) layers and
    distilled N steps (not tuned first), exported with its own layers moved up behind the new ones."""
    from specd.engine.loading import load_causal_lm

    start, out = tmp_path / "start", tmp_path / "out"
    draft = small_draft()
    train_draft.stage_export(SimpleNamespace(out=start), draft)
    (tmp_path / "shards").mkdir()
    torch.save({"plan": {}, "rows": fake_rows(4, 20)}, tmp_path / "shards" / "00000.pt")
    train_draft.main(["train", "--work", str(tmp_path), "--out", str(out), "--tune-from", str(start), "--draft-vocab", "520",
                      "--grow-layers", "3,4", "--grow-steps", "2", "--warmup", "1", "--batch", "2", "--seq", "16",
                      "--threads", "1", "--log-every", "1"])
    assert torch.load(tmp_path / "grown.ckpt")["step"] == 2 and not (tmp_path / "tuned.ckpt").exists()
    grown = load_causal_lm(str(out)).model
    assert grown.config.num_hidden_layers == 5 and grown.config.borrowed_layers == 2 and grown.config.draft_vocab_size == 520
    # The exported draft's own layer is now the last; distilled two steps from where it was, not from layer 29.
    exported = load_causal_lm(str(start)).model
    moved_by_training = grown.model.layers[4].mlp.up_proj.weight - exported.model.layers[2].mlp.up_proj.weight
    assert 0 < moved_by_training.abs().max() < 0.05

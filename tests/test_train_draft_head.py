"""The draft recipe's head stage (tools/train_draft.py --tune-from D --head-steps N): D's output
layer widened and distilled alone over hidden states computed once, its layers untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import train_draft  # noqa: E402

from tests.small_drafts import moved_small_draft  # noqa: E402
from tests.test_train_draft_tune import VOCAB, fake_rows  # noqa: E402


def head_args(tmp_path: Path, start: Path, **overrides) -> SimpleNamespace:
    values = dict(tune_from=start, draft_vocab=600, work=tmp_path, out=tmp_path / "out", seed=7, seq=16, batch=3, threads=1,
                  device="cpu", head_steps=3, head_lr=1e-2, head_batch=32, warmup=1, log_every=1, save_every=1)
    values.update(overrides)
    return SimpleNamespace(**values)


def exported_small_draft(tmp_path: Path) -> Path:
    start = tmp_path / "start"
    train_draft.stage_export(SimpleNamespace(out=start), moved_small_draft(VOCAB))
    return start


def test_head_inputs_are_the_drafts_final_hidden_states_and_the_targets_labels_at_every_position(tmp_path):
    from specd.models import load_causal_lm

    start = exported_small_draft(tmp_path)
    rows = fake_rows(4, 20) + fake_rows(1, 11)  # two lengths: batches are padded
    args = head_args(tmp_path, start)
    draft, vocab = train_draft.tune_start(args, rows)
    inputs = train_draft.head_inputs(args, draft, rows, vocab)
    # Each row is cut to seq + 1 tokens and predicts its next token at all but the last.
    assert inputs["hidden"].shape == (4 * 16 + 10, 576) and inputs["label_ids"].shape == (4 * 16 + 10, 4)
    vocab_index = {token: index for index, token in enumerate(vocab.tolist())}
    # The rows are taken shortest first: the 11-token row's positions come first.
    short = rows[4]
    ids = torch.tensor([short["prompt_ids"] + short["generated_ids"]])  # [1, 11]
    reference = load_causal_lm(str(start)).model
    with torch.no_grad():
        expected = reference.model(input_ids=ids).last_hidden_state[0, :10]  # [10, H]
    torch.testing.assert_close(inputs["hidden"][:10], expected, rtol=1e-4, atol=1e-4)
    assert inputs["label_ids"][:10].tolist() == [[vocab_index.get(t, -1) for t in top] for top in short["top_ids"][:10].tolist()]
    torch.testing.assert_close(inputs["label_logp"][:10], short["top_logprobs"][:10].float())
    assert (tmp_path / "head_inputs.pt").exists()


def test_head_inputs_are_cached_for_their_draft_and_vocabulary_only(tmp_path):
    start = exported_small_draft(tmp_path)
    rows = fake_rows(4, 20)
    args = head_args(tmp_path, start)
    draft, vocab = train_draft.tune_start(args, rows)
    first = train_draft.head_inputs(args, draft, rows, vocab)
    with torch.no_grad():
        draft.model.norm.weight.mul_(2.0)  # would change every hidden state if they were computed again
    assert torch.equal(train_draft.head_inputs(args, draft, rows, vocab)["hidden"], first["hidden"])
    wider = train_draft.head_inputs(args, draft, rows, torch.cat([vocab, torch.tensor([49151])]))
    torch.testing.assert_close(wider["hidden"], 2.0 * first["hidden"], rtol=1e-4, atol=1e-4)


def test_the_head_stage_trains_the_widened_output_layer_alone_and_resumes(tmp_path):
    from specd.models import load_causal_lm

    start = exported_small_draft(tmp_path)
    rows = fake_rows(4, 20)
    args = head_args(tmp_path, start, head_steps=2)
    tuned = train_draft.stage_tune_head(args, rows)
    assert torch.load(tmp_path / "head.ckpt")["step"] == 2
    exported = load_causal_lm(str(start)).model
    assert tuned.config.draft_vocab_size == 600 and set(VOCAB.tolist()) <= set(tuned.lm_head.token_ids.tolist())
    for name, param in tuned.model.named_parameters():  # every layer, the norm, the embedding: as exported
        assert torch.equal(param, exported.model.get_parameter(name)), name
    rows_of = dict(zip(tuned.lm_head.token_ids.tolist(), tuned.lm_head.weight))
    old = dict(zip(exported.lm_head.token_ids.tolist(), exported.lm_head.weight))
    assert any(not torch.equal(rows_of[token], old[token]) for token in VOCAB.tolist())
    # Resumed: a longer schedule continues from the checkpoint's step 2, and the export loads.
    train_draft.stage_export(args, train_draft.stage_tune_head(head_args(tmp_path, start, head_steps=3), rows))
    assert torch.load(tmp_path / "head.ckpt")["step"] == 3
    assert load_causal_lm(str(args.out)).model.config.draft_vocab_size == 600


def test_the_head_stage_lowers_the_kl_it_trains_on(tmp_path):
    start = exported_small_draft(tmp_path)
    rows = fake_rows(4, 20)
    args = head_args(tmp_path, start, head_steps=30, head_batch=64)
    draft, vocab = train_draft.tune_start(args, rows)
    inputs = train_draft.head_inputs(args, draft, rows, vocab)

    def kl(model) -> float:
        with torch.no_grad():
            logits = inputs["hidden"] @ model.lm_head.weight.T  # [n, N]
            return train_draft.top_k_kl(logits[None], inputs["label_ids"].long()[None], inputs["label_logp"][None],
                                        torch.ones(1, len(logits))).item()

    before = kl(draft)
    assert kl(train_draft.stage_tune_head(args, rows)) < before - 0.1


@pytest.mark.parametrize("extra", [["--grow-steps", "2", "--tune-from", "D"], []])
def test_head_steps_need_tune_from_and_no_grow_stage(tmp_path, capsys, extra):
    with pytest.raises(SystemExit):
        train_draft.main(["train", "--work", str(tmp_path), "--head-steps", "2", *extra])
    assert "--head-steps tunes the output layer of the draft at --tune-from" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())

"""The draft recipe's grow stage (recipes/train_draft.py): a deeper draft that starts out as the
trained one.

The new layers sit right after the borrowed ones with their output projections zeroed, so
before any training step the grown draft's logits equal the trained draft's; the layers that
were trained move up by the number added and keep their weights.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

import draft_stages  # noqa: E402
import train_draft  # noqa: E402

from tests.small_drafts import moved_small_draft  # noqa: E402


@pytest.fixture(scope="module")
def trained():
    """A 2 + 1 layer draft over 512 tokens, as training would leave it."""
    args = SimpleNamespace(borrowed_layers=2, trained_layers=1, seed=7, grow_layers="3,4", grow_steps=0, grow_lr=0.0, work=Path("unused"))
    vocab = torch.arange(0, 49152, 96)  # [512]
    return args, vocab, moved_small_draft(vocab)


@pytest.fixture(scope="module")
def grown(trained):
    """The trained draft grown by two layers, before any training step."""
    args, vocab, draft = trained
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(draft_stages, "distill", lambda args, grown, *rest, **kwargs: grown.eval())
        return draft_stages.stage_grow(args, [], vocab, draft)


def test_the_grown_draft_starts_out_as_the_trained_one(trained, grown):
    _, _, draft = trained
    assert grown.config.num_hidden_layers == 5 and grown.config.borrowed_layers == 2
    ids = torch.randint(0, 49152, (2, 40), generator=torch.Generator().manual_seed(1))  # [2, 40]
    with torch.no_grad():
        before, after = draft(input_ids=ids).logits, grown(input_ids=ids).logits  # [2, 40, V]
    inside = torch.isfinite(before)
    assert torch.equal(inside, torch.isfinite(after))
    torch.testing.assert_close(after[inside], before[inside], rtol=0, atol=1e-5)
    trained_state, grown_state = draft.state_dict(), grown.state_dict()
    for key, tensor in trained_state.items():
        moved = key.replace("layers.2.", "layers.4.", 1) if key.startswith("model.layers.2.") else key
        assert torch.equal(grown_state[moved], tensor), key


def test_the_new_layers_start_from_the_named_target_layers(grown):
    from safetensors import safe_open

    from specd.engine.default_target import target_folder

    with safe_open(str(target_folder() / "model.safetensors"), framework="pt") as target:
        for index, source in ((2, 3), (3, 4)):
            layer = grown.model.layers[index]
            assert torch.equal(layer.self_attn.q_proj.weight, target.get_tensor(f"model.layers.{source}.self_attn.q_proj.weight"))
            assert torch.equal(layer.mlp.up_proj.weight, target.get_tensor(f"model.layers.{source}.mlp.up_proj.weight"))
            assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()


def test_a_draft_that_borrows_another_number_of_layers_is_not_grown(trained):
    args, vocab, draft = trained
    with pytest.raises(SystemExit, match="borrows 2 layers, not --borrowed-layers 3"):
        train_draft.stage_grow(SimpleNamespace(**{**vars(args), "borrowed_layers": 3}), [], vocab, draft)

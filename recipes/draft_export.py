"""The export stage: the committed folder of a trained draft."""

from __future__ import annotations


def stage_export(args, draft) -> None:
    """The committed folder: config, the draft's own weights in bf16, the target's tokenizer files."""
    import shutil

    from specd.engine.default_target import target_folder
    from specd.engine.draft_model import save_draft

    save_draft(draft, str(args.out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(target_folder() / name, args.out / name)
    size = sum(p.stat().st_size for p in args.out.iterdir()) / 1e6
    print(f"exported the draft to {args.out} ({size:.1f} MB with its README and prompts)", flush=True)

"""Writing a trained draft: fp16 safetensors with its config and target identity, and the manifest beside it."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dspark.models.draft import FORMAT, METADATA_KEY, DraftModel, file_sha256, manifest_path, target_identity
from dspark.util.fileio import atomic_write, atomic_write_text


def round_to_file(draft: DraftModel) -> None:
    """Round the draft's parameters to the file's float16 in place: what is measured is what ships."""
    with torch.no_grad():
        for weight in draft.parameters():
            weight.copy_(weight.half())


def save_draft(draft: DraftModel, target: nn.Module, out: Path, manifest: dict) -> dict:
    """Write `draft` for `target` to `out` and its manifest (`manifest_path(out)`), both atomically.

    Args:
        draft: the trained draft (parameters saved as float16, vocabulary ids as int32).
        target: the model it was trained for (its identity goes into the file's metadata).
        out: the safetensors path.
        manifest: entries recorded after the file's name, sha256 and size.
    Returns:
        the manifest as written, read back.
    """
    from safetensors.torch import save_file

    state = {k: (v.to(torch.int32) if k == "vocab_ids" else v.detach().to(torch.float16)).cpu().contiguous()
             for k, v in draft.state_dict().items()}
    # one metadata key: safetensors writes several in hash order, which would change the file's bytes
    meta = {METADATA_KEY: json.dumps({"format": FORMAT, "config": draft.cfg.to_dict(),
                                      "target": target_identity(target)}, sort_keys=True)}
    atomic_write(out, lambda tmp: save_file(state, str(tmp), metadata=meta))
    manifest = {"weights": Path(out).name, "sha256": file_sha256(out), "bytes": Path(out).stat().st_size, **manifest}
    text = json.dumps(manifest, indent=1) + "\n"
    atomic_write_text(manifest_path(out), text)
    return json.loads(text)  # as a reader sees it (tuples become lists)

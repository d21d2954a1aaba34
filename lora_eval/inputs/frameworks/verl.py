"""verl's DataProto dumps: refused, never unpickled, pointing at the export snippet in references/README.md.

Follows verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9: verl/protocol.py `DataProto.save_to_disk` is
`pickle.dump(self)` (426-428), written by verl/utils/skip/rollout_skip.py as `{step}/gen_batch.dp`; the keys a
reference needs (prompts, responses, response_mask, rollout_log_probs, old_log_probs, routed_experts) come from
verl/experimental/agent_loop/agent_loop.py `_postprocess`. A pickle runs code as it loads, so lora-eval reads none:
the user exports in the environment that wrote it (which trusts its own file)."""

from __future__ import annotations

from pathlib import Path

from ...errors import InputError
from .common import EXPORTS

PICKLE = b"\x80"  # protocol 2+ pickles start with PROTO
TORCH_LEGACY = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"  # torch's pre-zip .pt: a pickled magic number first


def is_pickle(head: bytes) -> bool:
    """A plain pickle (not torch's legacy format, which torch.load(weights_only=True) reads)."""
    return head.startswith(PICKLE) and not head.startswith(TORCH_LEGACY)


def refuse(path: Path, head: bytes) -> InputError:
    what = "a pickled verl DataProto (gen_batch.dp)" if b"DataProto" in head else "a Python pickle"
    return InputError(path, f"refused: not a plain tensor file: {what}, which lora-eval never unpickles (loading a "
                      f"pickle runs code); turn it into our Parquet in your own environment with the few lines in "
                      f"{EXPORTS} (verl)")

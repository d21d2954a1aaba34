"""TEMPORARY stand-in (coordinator's local testing; replaced by the helper's file)."""
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule


def gated_delta_rule_ref(q, k, v, g, beta, initial_state=None, output_final_state=False):
    return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)


gated_delta_rule = gated_delta_rule_ref


def causal_conv1d_ref(x, weight, state=None):
    B, L, C = x.shape
    W = weight.shape[1]
    if state is None:
        state = x.new_zeros(B, W - 1, C)
    full = torch.cat([state.to(x.dtype), x], dim=1)  # [B, W-1+L, C]
    y = F.conv1d(full.transpose(1, 2), weight.unsqueeze(1), groups=C)  # [B, C, L]
    return F.silu(y).transpose(1, 2).to(x.dtype), full[:, -(W - 1):]


causal_conv1d = causal_conv1d_ref

"""The cache layout a model declares: what one request's cache holds, per token and per request.

Owns ``CacheLayout``, the one description the rest of the cluster reads (the KV store's hit
rule and block payload, the transfer's expected frames, the workers' sinks) instead of asking
which model it is::

    per token, per MLA layer   one row [latent_dim] = [ normalised latent (kv_lora_rank) | rope key ]
    per request, per state layer (KDA)   recurrent state [H, Dk, Dv] and short-conv window [K-1, C],
                               resumable only where a snapshot of them was kept

A layout without state layers (an all-attention model such as DeepSeek-V3/K2) can resume at
every block boundary: its "snapshot" is empty and always there.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 32  # tokens per page and per block, unless a worker is told otherwise


@dataclass(frozen=True)
class CacheLayout:
    mla_layer_ids: tuple[int, ...]
    latent_dim: int
    rope_dim: int  # the rope key's share of latent_dim (rotated by position when the model uses RoPE)
    state_layer_ids: tuple[int, ...] = ()
    state_shape: tuple[int, ...] = ()  # [H, Dk, Dv] per state layer; () without state layers
    conv_shape: tuple[int, ...] = ()  # [K-1, C] per state layer; () without state layers

    def __post_init__(self) -> None:
        if bool(self.state_layer_ids) != bool(self.state_shape) or bool(self.state_layer_ids) != bool(self.conv_shape):
            raise ValueError(f"state layers {self.state_layer_ids} need both a state shape and a conv shape, "
                             f"got {self.state_shape} and {self.conv_shape}")
        if not 0 <= self.rope_dim <= self.latent_dim:
            raise ValueError(f"rope_dim {self.rope_dim} outside [0, latent_dim {self.latent_dim}]")

    @property
    def has_state(self) -> bool:
        """Whether a request carries per-request state that must be snapshotted to resume."""
        return bool(self.state_layer_ids)

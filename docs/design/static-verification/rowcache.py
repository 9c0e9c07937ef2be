"""Experiment only (not project code): a per-row static KV cache for transformers 5.x models."""
import os, torch
from transformers.cache_utils import Cache, CacheLayerMixin


class RowLayer(CacheLayerMixin):
    is_compileable = True
    is_sliding = False

    def __init__(self, owner, keys, values):
        super().__init__()
        self.owner, self.keys, self.values = owner, keys, values
        self.is_initialized = True

    def lazy_initialization(self, k, v):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        q = key_states.shape[-2]
        idx = self.owner.write_pos[:, :q]  # (B, q) absolute slots, static buffer
        b, h, _, d = key_states.shape
        ix = idx[:, None, :, None].expand(b, h, q, d)
        self.keys.scatter_(2, ix, key_states)
        self.values.scatter_(2, ix, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length):
        return self.keys.shape[-2], 0

    def get_seq_length(self):
        return int(max(self.owner.lengths))

    def get_max_length(self):
        return self.keys.shape[-2]

    def crop(self, n):
        raise NotImplementedError

    def reset(self):
        self.keys.zero_(); self.values.zero_()


class RowCache(Cache):
    def __init__(self, config, batch, max_len, max_q, dtype, device):
        n_layers = config.num_hidden_layers
        kvh = getattr(config, "num_key_value_heads", config.num_attention_heads)
        hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.write_pos = torch.zeros(batch, max_q, dtype=torch.long, device=device)
        self.lengths = [0] * batch
        layers = []
        for _ in range(n_layers):
            k = torch.zeros(batch, kvh, max_len, hd, dtype=dtype, device=device)
            v = torch.zeros_like(k)
            if not os.environ.get("NOSTATIC"): torch._dynamo.mark_static_address(k); torch._dynamo.mark_static_address(v)
            layers.append(RowLayer(self, k, v))
        if not os.environ.get("NOSTATIC"): torch._dynamo.mark_static_address(self.write_pos)
        super().__init__(layers=layers)

"""A plain PyTorch GPT: the reference tfgpt's training speed is compared with.

Written here in the nanoGPT style (one fused query/key/value Linear, causal
`scaled_dot_product_attention`, pre-layer-norm blocks, tanh GELU, tied
embeddings), with the same shapes, the same N(0, 0.02) initialisation and
the same AdamW settings as tfgpt's trainer (betas 0.9/0.95, epsilon 1e-8,
decoupled decay on the matrices only, global-norm clipping). It is a
bench-only reference: nothing in `tfgpt` imports torch.

Example:
>>> model = TorchGPT(vocabulary_size=100, num_layers=2, num_heads=2,
...                  hidden_dim=16, intermediate_dim=64, max_sequence_length=8)
>>> model(torch.zeros(1, 8, dtype=torch.long)).shape
torch.Size([1, 8, 100])
"""

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.query_key_value = nn.Linear(hidden_dim, 3 * hidden_dim)
        self.output_projection = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x):
        batch, length, channels = x.shape
        head_dim = channels // self.num_heads
        qkv = self.query_key_value(x)  # (B, T, 3C)
        qkv = qkv.view(batch, length, 3, self.num_heads, head_dim)  # (B, T, 3, H, D)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D)
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)  # (B, H, T, D)
        attended = attended.transpose(1, 2).reshape(batch, length, channels)  # (B, T, C)
        return self.output_projection(attended)


class Block(nn.Module):
    def __init__(self, hidden_dim, num_heads, intermediate_dim, epsilon):
        super().__init__()
        self.attention_norm = nn.LayerNorm(hidden_dim, eps=epsilon)
        self.attention = CausalSelfAttention(hidden_dim, num_heads)
        self.feedforward_norm = nn.LayerNorm(hidden_dim, eps=epsilon)
        self.feedforward_intermediate = nn.Linear(hidden_dim, intermediate_dim)
        self.feedforward_output = nn.Linear(intermediate_dim, hidden_dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        hidden = F.gelu(self.feedforward_intermediate(self.feedforward_norm(x)), approximate="tanh")
        return x + self.feedforward_output(hidden)


class TorchGPT(nn.Module):
    """GPT-2-shaped decoder (pre-LN, tied embeddings), as tfgpt's `GPT`."""

    def __init__(self, vocabulary_size, num_layers, num_heads, hidden_dim, intermediate_dim,
                 max_sequence_length, layer_norm_epsilon=1e-5, **unused):
        super().__init__()
        self.token_embedding = nn.Embedding(vocabulary_size, hidden_dim)
        self.position_embedding = nn.Embedding(max_sequence_length, hidden_dim)
        self.blocks = nn.ModuleList(
            Block(hidden_dim, num_heads, intermediate_dim, layer_norm_epsilon)
            for _ in range(num_layers)
        )
        self.final_norm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)
        for module in self.modules():
            # tfgpt's initialisation: N(0, 0.02) weights, zero biases.
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, token_ids):
        length = token_ids.shape[1]
        positions = torch.arange(length, device=token_ids.device)
        x = self.token_embedding(token_ids) + self.position_embedding(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        return (x @ self.token_embedding.weight.t()).float()  # (B, T, V), tied


def make_optimizer(model, learning_rate=1e-3, weight_decay=0.1):
    """tfgpt's AdamW: decay only Linear weights (not biases, norms, embeddings)."""
    decay = [p for name, p in model.named_parameters() if p.dim() == 2 and "embedding" not in name]
    no_decay = [p for name, p in model.named_parameters() if not (p.dim() == 2 and "embedding" not in name)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=learning_rate, betas=(0.9, 0.95), eps=1e-8,
    )


class TorchTrainStep:
    """One AdamW step with global-norm clipping; optionally bf16 autocast.

    Args:
        model: TorchGPT.
        optimizer: torch optimizer.
        bfloat16: bool. Autocast the forward pass to bfloat16 (CPU autocast;
            weights and the optimizer stay float32), the counterpart of
            Keras' `mixed_bfloat16` policy.
        compile: bool. `torch.compile` the forward and backward pass.
        clip_norm: float. Global gradient-norm clip, 0 for none.
    """

    def __init__(self, model, optimizer, bfloat16=False, compile=False, clip_norm=1.0):
        self.model = model
        self.optimizer = optimizer
        self.bfloat16 = bfloat16
        self.clip_norm = clip_norm
        self.loss_fn = torch.compile(self._loss) if compile else self._loss

    def _loss(self, inputs, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bfloat16):
            logits = self.model(inputs)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    def __call__(self, inputs, targets):
        loss = self.loss_fn(inputs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.optimizer.step()
        return {"loss": loss.detach()}


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())


def flops_per_token(model, sequence_length):
    """The same 6N + 12·L·C·T as `tfgpt.observe.flops` (N without positions)."""
    hidden = model.token_embedding.weight.shape[1]
    matmul = parameter_count(model) - model.position_embedding.weight.numel()
    return 6 * matmul + 12 * len(model.blocks) * hidden * sequence_length


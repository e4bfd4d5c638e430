"""A zoo of tiny models written the way public libraries write them (nanoGPT/HF GPT-2, HF BERT,
torchvision's ResNet, timm's ViT and MLP-Mixer, PyTorch's word-language-model example, a U-Net), for
testing the per-example rules on whole architectures.

Each entry makes a model, a batch ``(x, y)`` of B examples and a loss whose ``reduction="mean"`` over
the batch is the mean of the examples' own losses (token and pixel losses: each example has as many
terms as every other). A position table is an ``nn.Embedding`` looked up with ``(1, T)`` ids as in HF
GPT-2 and BERT and added to the examples' embeddings: measured per example where the add broadcasts it
(nanoGPT's ``arange(T)`` and dropout after the sum: tests/per_example/test_positions.py). An entry with
dropout in training (``random``) has its brute force through one forward of the batch: each example's loss
differentiated alone, so that it sees the masks the measured forward draws from the same seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, T, D = 11, 6, 16


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one Linear for q, k, v, scaled dot-product attention, an output Linear."""

    def __init__(self, dim: int, heads: int, causal: bool = True) -> None:
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.heads, self.causal = heads, causal

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class PreLNBlock(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), CausalSelfAttention(dim, heads, causal)
        self.ln_2, self.mlp = nn.LayerNorm(dim), Mlp(dim, 4 * dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A pre-LN decoder whose output layer is its token embedding (GPT-2)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.h = nn.ModuleList(PreLNBlock(D, 2, causal=True) for _ in range(2))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("position_ids", torch.arange(T).unsqueeze(0), persistent=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(self.position_ids[:, : idx.shape[1]])
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class BertLayer(nn.Module):
    """Post-LN: attention (nn.MultiheadAttention) and feed-forward, each followed by add & LayerNorm."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.attention_norm = nn.LayerNorm(dim)
        self.intermediate, self.output = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.output_norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor, padding: Tensor) -> Tensor:
        attended, _ = self.attention(x, x, x, key_padding_mask=padding, need_weights=False)
        x = self.attention_norm(x + attended)
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))


class Bert(nn.Module):
    """A BERT-style encoder classifying from its [CLS] token through a tanh pooler; token 0 is padding."""

    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, D, padding_idx=0)
        self.position_embeddings = nn.Embedding(T, D)
        self.embeddings_norm = nn.LayerNorm(D)
        self.layers = nn.ModuleList(BertLayer(D, 2) for _ in range(2))
        self.pooler, self.classifier = nn.Linear(D, D), nn.Linear(D, 3)
        self.register_buffer("position_ids", torch.arange(T).unsqueeze(0), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.word_embeddings(tokens) + self.position_embeddings(self.position_ids[:, : tokens.shape[1]])
        x = self.embeddings_norm(x)
        for layer in self.layers:
            x = layer(x, tokens == 0)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


class BasicBlock(nn.Module):
    """torchvision's ResNet block: conv-norm-relu-conv-norm, a 1×1 projection when the shape changes; as there, the
    ReLUs and the residual add change the norms' outputs in place."""

    def __init__(self, cin: int, cout: int, stride: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), norm(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), norm(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False), norm(8)
        self.layer1, self.layer2 = BasicBlock(8, 8, 1, norm), BasicBlock(8, 16, 2, norm)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer2(self.layer1(F.relu(self.bn1(self.conv1(x)), inplace=True)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet_batchnorm_eval() -> nn.Module:
    """With BatchNorm: in eval mode (running statistics), each example on its own."""
    model = ResNet(nn.BatchNorm2d)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 1.5)
    return model.eval()


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 8, padding_idx=0)
        self.lstm = nn.LSTM(8, 12, num_layers=2, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(2 * 12, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        _, (h, _) = self.lstm(self.embedding(tokens))
        return self.fc(torch.cat([h[-2], h[-1]], 1))


class GRULanguageModel(nn.Module):
    """PyTorch's word-language-model example: encoder, GRU and decoder on sequence-first ``(T, B)``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, 10)
        self.rnn = nn.GRU(10, 12, num_layers=2)
        self.decoder = nn.Linear(12, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        output, _ = self.rnn(self.encoder(tokens.t()))  # (T, B, H)
        return self.decoder(output).transpose(0, 1)  # (B, T, VOCAB)


class RNNModel(nn.Module):
    """PyTorch's word_language_model example as it writes it: dropout on the embeddings, between the
    LSTM's layers and on its output, the decoder tied to the encoder; sequence-first ``(T, B)`` inside."""

    def __init__(
        self,
        ntoken: int = VOCAB,
        ninp: int = 12,
        nhid: int = 12,
        nlayers: int = 2,
        dropout: float = 0.2,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            self.decoder.weight = self.encoder.weight

    def forward(self, tokens: Tensor) -> Tensor:
        emb = self.drop(self.encoder(tokens.t()))
        output, _ = self.rnn(emb)  # the example's init_hidden: zeros
        decoded = self.decoder(self.drop(output))
        return F.log_softmax(decoded, dim=-1).transpose(0, 1)  # (B, T, VOCAB)


class PackedLSTMClassifier(LSTMClassifier):
    """The LSTM classifier on padded token ids, each sequence packed at its own length (0 pads)."""

    def forward(self, tokens: Tensor) -> Tensor:
        lengths = (tokens != 0).sum(1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(
            self.embedding(tokens), lengths, batch_first=True, enforce_sorted=False
        )
        _, (h, _) = self.lstm(packed)
        return self.fc(torch.cat([h[-2], h[-1]], 1))


class TransformerLanguageModel(nn.Module):
    """PyTorch's word-language-model example's TransformerModel: sinusoidal positions, nn.TransformerEncoder of
    nn.TransformerEncoderLayer at its defaults (dropout 0.1 in attention, feed-forward and residuals; post-LN;
    sequence-first) under a causal mask, a decoder Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, D)
        position = torch.arange(T).unsqueeze(1) * torch.exp(torch.arange(0, D, 2) * (-math.log(10000.0) / D))
        self.register_buffer("pe", torch.stack([position.sin(), position.cos()], -1).flatten(1).unsqueeze(1))
        self.dropout = nn.Dropout(0.1)
        self.transformer = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 2, 2 * D), 2, enable_nested_tensor=False)
        self.decoder = nn.Linear(D, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.dropout(self.encoder(tokens.t()) * math.sqrt(D) + self.pe[: tokens.shape[1]])  # (T, B, D)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], dtype=x.dtype)
        return self.decoder(self.transformer(x, mask=mask, is_causal=True)).transpose(0, 1)  # (B, T, VOCAB)


class ViT(nn.Module):
    """timm's VisionTransformer without a class token (global average pooling): patch Conv2d, a learned
    position table, pre-LN blocks, final LayerNorm, head."""

    def __init__(self, image: int = 8, patch: int = 4) -> None:
        super().__init__()
        patches = (image // patch) ** 2
        self.patch_embed = nn.Conv2d(3, D, patch, patch)
        self.pos_embed = nn.Embedding(patches, D)
        self.blocks = nn.Sequential(*(PreLNBlock(D, 2, causal=False) for _ in range(2)))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 4)
        self.register_buffer("position_ids", torch.arange(patches).unsqueeze(0), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, D)
        x = self.blocks(x + self.pos_embed(self.position_ids))
        return self.head(self.norm(x).mean(1))


class ViTClassToken(nn.Module):
    """timm's and torchvision's VisionTransformer as written there: a bare class token expanded over the batch and
    concatenated, a bare position table ``(1, N + 1, D)`` added, dropout, the head on the class token."""

    def __init__(self, image: int = 8, patch: int = 4) -> None:
        super().__init__()
        patches = (image // patch) ** 2
        self.patch_embed = nn.Conv2d(3, D, patch, patch)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, D))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, patches + 1, D))
        self.pos_drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(*(PreLNBlock(D, 2, causal=False) for _ in range(2)))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, D)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.blocks(self.pos_drop(x + self.pos_embed))
        return self.head(self.norm(x)[:, 0])


class ConvNeXtBlock(nn.Module):
    """The official ConvNeXt block: a depthwise 7×7 conv, a channels-last LayerNorm and MLP, the residual scaled
    by a bare layer-scale ``gamma`` beside those children."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm, self.pwconv1, self.pwconv2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-1 * torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))  # (B, H, W, C)
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, D, 2, 2)
        self.blocks = nn.Sequential(ConvNeXtBlock(D), ConvNeXtBlock(D))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.stem(x)).mean((2, 3))))


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1, self.mlp_tokens = nn.RMSNorm(dim), Mlp(tokens, 2 * tokens)
        self.norm2, self.mlp_channels = nn.RMSNorm(dim), Mlp(dim, 2 * dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.mlp_channels(self.norm2(x))


class Mixer(nn.Module):
    """timm's MLP-Mixer with RMSNorm: patch Conv2d stem, token- and channel-mixing MLPs."""

    def __init__(self, image: int = 8, patch: int = 2) -> None:
        super().__init__()
        tokens = (image // patch) ** 2
        self.stem = nn.Conv2d(3, D, patch, patch)
        self.blocks = nn.Sequential(*(MixerBlock(tokens, D) for _ in range(2)))
        self.norm, self.head = nn.RMSNorm(D), nn.Linear(D, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks(self.stem(x).flatten(2).transpose(1, 2))
        return self.head(self.norm(x).mean(1))


def double_conv(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1),
        nn.GroupNorm(2, cout),
        nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1),
        nn.GroupNorm(2, cout),
        nn.ReLU(),
    )


class UNet(nn.Module):
    """A two-level U-Net: down by max-pooling, up by ConvTranspose2d, skip connections concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.inc, self.down = double_conv(2, 4), double_conv(4, 8)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.dec, self.outc = double_conv(8, 4), nn.Conv2d(4, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        skip = self.inc(x)
        up = self.up(self.down(F.max_pool2d(skip, 2)))
        return self.outc(self.dec(torch.cat([skip, up], 1)))


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass(frozen=True)
class Entry:
    make: Callable[[], nn.Module]
    batch: Callable[[int], tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]  # reduction="mean": the mean of the examples' own losses
    shared_lookup: str | None = None  # the position table, looked up with ids shared by the batch (the benchmark
    # freezes it: the peers have no rule for it)
    random: bool = False  # draws dropout masks in training: the truth is each example's loss in one forward


def _tokens(b: int, labels: int | None = None) -> tuple[Tensor, Tensor]:
    x = torch.randint(1, VOCAB, (b, T))
    x[0, :3] = 5  # a repeated token
    x[1, -2:] = 0  # padding (the padding row of the tables that have one)
    return x, torch.randint(0, labels, (b,)) if labels else torch.randint(0, VOCAB, (b, T))


def _padded_tokens(b: int, labels: int = 3) -> tuple[Tensor, Tensor]:
    """Token ids padded with 0 at the end, each sequence of its own length (1 to T)."""
    x = torch.randint(1, VOCAB, (b, T))
    lengths = torch.tensor([T, 2, T - 1, 1, 4, T - 3])[torch.arange(b) % 6]
    x[torch.arange(T) >= lengths[:, None]] = 0
    return x, torch.randint(0, labels, (b,))


def _images(b: int, channels: int = 3, labels: int = 4) -> tuple[Tensor, Tensor]:
    return torch.randn(b, channels, 8, 8), torch.randint(0, labels, (b,))


ZOO: dict[str, Entry] = {
    "gpt_tied": Entry(GPT, _tokens, token_loss, "wpe"),
    "bert_multihead_attention": Entry(Bert, lambda b: _tokens(b, 3), F.cross_entropy, "position_embeddings"),
    "resnet_batchnorm_eval": Entry(resnet_batchnorm_eval, _images, F.cross_entropy),
    "resnet_groupnorm": Entry(lambda: ResNet(lambda c: nn.GroupNorm(2, c)), _images, F.cross_entropy),
    "lstm_classifier": Entry(LSTMClassifier, lambda b: _tokens(b, 3), F.cross_entropy),
    "gru_language_model": Entry(GRULanguageModel, _tokens, token_loss),
    "word_language_model_dropout": Entry(RNNModel, _tokens, token_loss, random=True),
    "lstm_classifier_packed": Entry(PackedLSTMClassifier, _padded_tokens, F.cross_entropy),
    "transformer_dropout": Entry(TransformerLanguageModel, _tokens, token_loss, random=True),
    "vit": Entry(ViT, _images, F.cross_entropy, "pos_embed"),
    "vit_class_token": Entry(ViTClassToken, _images, F.cross_entropy, random=True),
    "convnext_layer_scale": Entry(ConvNeXt, _images, F.cross_entropy),
    "mixer_rmsnorm": Entry(Mixer, _images, F.cross_entropy),
    "unet_conv_transpose": Entry(UNet, lambda b: (torch.randn(b, 2, 8, 8), torch.randn(b, 1, 8, 8)), F.mse_loss),
}

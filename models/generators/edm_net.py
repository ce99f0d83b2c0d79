"""The class-conditional EDM pixel networks of the CSM paper, as a diffusers ``ModelMixin``.

Karras et al. 2022 ("Elucidating the Design Space of Diffusion-Based Generative Models", EDM)
train two U-Nets under one preconditioning interface D(x; σ, y) = c_skip·x + c_out·F(c_in·x; c_noise, y):

- ``ddpmpp``: the DDPM++ network of Song et al. 2021 (score SDE): positional noise embedding,
  [sin, cos] order, residual blocks with additive embedding (no adaptive scale), one attention head,
  skip scale 1/√2, 2×2 box-filter resampling with 1×1 projections on the skip path, GroupNorm ε 1e-6;
- ``adm``: the ADM network of Dhariwal & Nichol 2021: positional embedding in [cos, sin] order,
  adaptive GroupNorm (scale, shift), 64 channels per attention head, label embedding added after
  the mapping MLP.

The class label y enters through a linear map (``map_label``) of a class-weight vector: a one-hot
for a pure class, α·e_a + (1−α)·e_b for a CSM mix (docs/methods.md §1), so mixing needs no extra code.

Preconditioning (EDM Table 1): ``vp`` (the "cond-vp" checkpoints of CIFAR-10/100, Tiny-ImageNet)
and ``edm``. Module and parameter names follow the checkpoints' state-dict layout
(``model.enc.32x32_block0.conv0.weight`` ...), so their weights load without renaming.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

ARCHITECTURES = ("ddpmpp", "adm")
PRECONDS = ("vp", "edm")


def group_norm(channels: int, eps: float) -> nn.GroupNorm:
    """GroupNorm with 32 groups, fewer when a group would hold fewer than 4 channels (as EDM)."""
    return nn.GroupNorm(min(32, channels // 4), channels, eps=eps)


class Resample(nn.Module):
    """Conv layer with optional 2× FIR up/down-sampling before it (kernel 0 = resampling only).

    The FIR filter f = ffᵀ/(Σf)² (for [1, 1]: a 2×2 box) is applied per channel: upsampling is a
    stride-2 transposed convolution with 4·f (nearest neighbour for the box), downsampling a
    stride-2 convolution with f (2×2 average). ``resample_filter`` is a persistent buffer, as in the
    checkpoints.
    """

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int,
        bias: bool = True,
        up: bool = False,
        down: bool = False,
        resample_filter: Sequence[int] = (1, 1),
    ) -> None:
        super().__init__()
        self.up, self.down = up, down
        self.weight = nn.Parameter(torch.empty(cout, cin, kernel, kernel)) if kernel else None
        self.bias = nn.Parameter(torch.zeros(cout)) if kernel and bias else None
        if kernel:  # random weights as nn.Conv2d's (checkpoints overwrite them)
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        f = torch.as_tensor(list(resample_filter), dtype=torch.float32)
        f = torch.outer(f, f)[None, None] / f.sum().square()
        self.register_buffer("resample_filter", f if up or down else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.up or self.down:
            c = x.shape[1]
            f = self.resample_filter.to(x.dtype)
            pad = (f.shape[-1] - 1) // 2
            if self.up:
                x = F.conv_transpose2d(x, (4 * f).tile(c, 1, 1, 1), groups=c, stride=2, padding=pad)
            else:
                x = F.conv2d(x, f.tile(c, 1, 1, 1), groups=c, stride=2, padding=pad)
        if self.weight is not None:
            x = F.conv2d(x, self.weight, self.bias, padding=self.weight.shape[-1] // 2)
        return x


class Block(nn.Module):
    """Residual U-Net block: GN-SiLU-conv, embedding, GN-SiLU-dropout-conv, skip; then attention.

    ``adaptive``: the embedding gives (scale, shift) of the second GroupNorm (ADM); otherwise it is
    added before it (DDPM++).
    """

    def __init__(
        self,
        cin: int,
        cout: int,
        emb: int,
        *,
        up: bool = False,
        down: bool = False,
        heads: int = 0,
        dropout: float = 0.0,
        skip_scale: float = 1.0,
        eps: float = 1e-5,
        resample_filter: Sequence[int] = (1, 1),
        resample_proj: bool = False,
        adaptive: bool = True,
    ) -> None:
        super().__init__()
        self.in_channels, self.heads, self.adaptive = cin, heads, adaptive
        self.dropout, self.skip_scale = dropout, skip_scale
        rf = resample_filter
        self.norm0 = group_norm(cin, eps)
        self.conv0 = Resample(cin, cout, 3, up=up, down=down, resample_filter=rf)
        self.affine = nn.Linear(emb, cout * (2 if adaptive else 1))
        self.norm1 = group_norm(cout, eps)
        self.conv1 = Resample(cout, cout, 3)
        self.skip = None
        if cout != cin or up or down:
            kernel = 1 if resample_proj or cout != cin else 0
            self.skip = Resample(cin, cout, kernel, up=up, down=down, resample_filter=rf)
        if heads:
            self.norm2 = group_norm(cout, eps)
            self.qkv = Resample(cout, 3 * cout, 1)
            self.proj = Resample(cout, cout, 1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv0(F.silu(self.norm0(x)))
        p = self.affine(emb)[:, :, None, None]
        if self.adaptive:
            scale, shift = p.chunk(2, dim=1)
            h = F.silu(torch.addcmul(shift, self.norm1(h), scale + 1))
        else:
            h = F.silu(self.norm1(h + p))
        h = self.conv1(F.dropout(h, p=self.dropout, training=self.training))
        x = (h + (self.skip(x) if self.skip is not None else x)) * self.skip_scale
        if self.heads:
            # qkv channels are laid out as [head, channel, (q, k, v)]; softmax(qᵀk/√c) over keys
            b, c, hh, ww = x.shape
            qkv = self.qkv(self.norm2(x)).reshape(b * self.heads, c // self.heads, 3, hh * ww)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # [b·heads, hw, c/heads]
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, c, hh, ww)
            x = (self.proj(a) + x) * self.skip_scale
        return x


def positional_embedding(x: torch.Tensor, channels: int, endpoint: bool) -> torch.Tensor:
    """[cos(x·ω_i), sin(x·ω_i)], ω_i = (1/10⁴)^(i/(C/2 − endpoint)), i < C/2 (transformer style)."""
    half = channels // 2
    freqs = torch.arange(half, dtype=torch.float32, device=x.device) / (half - int(endpoint))
    freqs = (1 / 10000) ** freqs
    x = torch.outer(x, freqs.to(x.dtype))
    return torch.cat([x.cos(), x.sin()], dim=1)


class UNet(nn.Module):
    """DDPM++ (``ddpmpp``) or ADM (``adm``) U-Net F(x; c_noise, y) of EDM (its Appendix F.2)."""

    def __init__(
        self,
        architecture: str,
        img_resolution: int,
        in_channels: int,
        out_channels: int,
        label_dim: int,
        augment_dim: int,
        model_channels: int,
        channel_mult: Sequence[int],
        channel_mult_emb: int,
        num_blocks: int,
        attn_resolutions: Sequence[int],
        dropout: float,
        channel_mult_noise: int,
        resample_filter: Sequence[int],
    ) -> None:
        super().__init__()
        song = architecture == "ddpmpp"
        self.song, self.label_dim = song, label_dim
        emb = model_channels * channel_mult_emb
        self.noise_channels = model_channels * (channel_mult_noise if song else 1)
        kw = dict(emb=emb, dropout=dropout, resample_filter=resample_filter)
        if song:
            kw |= dict(skip_scale=math.sqrt(0.5), eps=1e-6, resample_proj=True, adaptive=False)

        def heads(cout: int, attention: bool) -> int:
            return 0 if not attention else 1 if song else cout // 64

        # Mapping: noise level (+ augmentation labels) -> embedding; class label y added linearly
        nc = self.noise_channels
        label_out = nc if song else emb
        self.map_label = nn.Linear(label_dim, label_out, bias=song) if label_dim else None
        self.map_augment = nn.Linear(augment_dim, nc, bias=False) if augment_dim else None
        self.map_layer0 = nn.Linear(nc, emb)
        self.map_layer1 = nn.Linear(emb, emb)

        # Encoder: per level a (down) block then num_blocks blocks; every output is a skip
        self.enc = nn.ModuleDict()
        cout = in_channels
        skips = []
        for level, mult in enumerate(channel_mult):
            res = img_resolution >> level
            if level == 0:
                cin, cout = cout, model_channels * (1 if song else mult)
                self.enc[f"{res}x{res}_conv"] = Resample(cin, cout, 3)
            else:
                self.enc[f"{res}x{res}_down"] = Block(cout, cout, down=True, **kw)
            skips.append(cout)
            for i in range(num_blocks):
                cin, cout = cout, model_channels * mult
                at = heads(cout, res in attn_resolutions)
                self.enc[f"{res}x{res}_block{i}"] = Block(cin, cout, heads=at, **kw)
                skips.append(cout)

        # Decoder: middle (attention) or up block, then num_blocks + 1 blocks eating the skips
        self.dec = nn.ModuleDict()
        for level, mult in reversed(list(enumerate(channel_mult))):
            res = img_resolution >> level
            if level == len(channel_mult) - 1:
                self.dec[f"{res}x{res}_in0"] = Block(cout, cout, heads=heads(cout, True), **kw)
                self.dec[f"{res}x{res}_in1"] = Block(cout, cout, **kw)
            else:
                self.dec[f"{res}x{res}_up"] = Block(cout, cout, up=True, **kw)
            for i in range(num_blocks + 1):
                cin, cout = cout + skips.pop(), model_channels * mult
                # DDPM++ attends only in the last block of a level, ADM in every one
                at = res in attn_resolutions and (i == num_blocks or not song)
                self.dec[f"{res}x{res}_block{i}"] = Block(cin, cout, heads=heads(cout, at), **kw)
            if song and level == 0:
                self.dec[f"{res}x{res}_aux_norm"] = group_norm(cout, 1e-6)
                self.dec[f"{res}x{res}_aux_conv"] = Resample(cout, out_channels, 3)
        if not song:
            self.out_norm = group_norm(cout, 1e-5)
            self.out_conv = Resample(cout, out_channels, 3)

    def embed(self, c_noise: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The block embedding from c_noise and y, computed in float32 whatever the weights' dtype
        (as EDM: c_noise reaches 999 under VP, and mixing weights need more than bf16's 8 bits)."""

        def lin(layer: nn.Linear, v: torch.Tensor) -> torch.Tensor:
            bias = None if layer.bias is None else layer.bias.float()
            return F.linear(v, layer.weight.float(), bias)

        e = positional_embedding(c_noise.float(), self.noise_channels, endpoint=self.song)
        labels = None if labels is None else labels.float()
        if self.song:
            e = torch.cat(e.chunk(2, dim=1)[::-1], dim=1)  # DDPM++ orders it [sin, cos]
            if self.map_label is not None:
                # y scaled by √label_dim so that a one-hot has unit mean square (DDPM++ in EDM)
                e = e + lin(self.map_label, labels * math.sqrt(self.label_dim))
            e = F.silu(lin(self.map_layer1, F.silu(lin(self.map_layer0, e))))
        else:
            e = lin(self.map_layer1, F.silu(lin(self.map_layer0, e)))
            if self.map_label is not None:
                e = e + lin(self.map_label, labels)
            e = F.silu(e)
        return e.to(self.map_layer0.weight.dtype)

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor, labels: torch.Tensor | None):
        emb = self.embed(c_noise, labels)
        skips = []
        for block in self.enc.values():
            x = block(x, emb) if isinstance(block, Block) else block(x)
            skips.append(x)
        out = None
        for name, block in self.dec.items():
            if name.endswith("aux_norm"):
                out = block(x)
            elif name.endswith("aux_conv"):
                out = block(F.silu(out))
            else:
                if x.shape[1] != block.in_channels:  # the blocks that take a skip
                    x = torch.cat([x, skips.pop()], dim=1)
                x = block(x, emb)
        return out if self.song else self.out_conv(F.silu(self.out_norm(x)))


class EDMNetwork(ModelMixin, ConfigMixin):
    """Preconditioned denoiser D(x; σ, y) of EDM; its config is the whole identity of the model.

    ``forward(x, sigma, class_labels)``: x [B, C, H, W], σ [B] or scalar, class_labels = class
    weights [B, label_dim] (one-hot or a mix); returns the denoised image estimate in float32.
    """

    config_name = "config.json"

    @register_to_config
    def __init__(
        self,
        img_resolution: int = 32,
        img_channels: int = 3,
        label_dim: int = 10,
        architecture: str = "ddpmpp",
        precond: str = "vp",
        augment_dim: int = 0,
        model_channels: int = 128,
        channel_mult: Sequence[int] = (2, 2, 2),
        channel_mult_emb: int = 4,
        num_blocks: int = 4,
        attn_resolutions: Sequence[int] = (16,),
        dropout: float = 0.13,
        channel_mult_noise: int = 1,
        resample_filter: Sequence[int] = (1, 1),
        # vp: σ(t) = sqrt(exp(½β_d t² + β_min t) − 1), t ∈ [ε_t, 1], c_noise = (M − 1)·t
        beta_d: float = 19.9,
        beta_min: float = 0.1,
        M: int = 1000,
        epsilon_t: float = 1e-5,
        # edm: σ_data, and the σ range the network supports (None = unbounded)
        sigma_data: float = 0.5,
        sigma_min: float | None = None,
        sigma_max: float | None = None,
    ) -> None:
        super().__init__()
        if architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={architecture!r}: choose one of {ARCHITECTURES}")
        if precond not in PRECONDS:
            raise ValueError(f"precond={precond!r}: choose one of {PRECONDS}")
        self.model = UNet(
            architecture,
            img_resolution,
            img_channels,
            img_channels,
            label_dim,
            augment_dim,
            model_channels,
            channel_mult,
            channel_mult_emb,
            num_blocks,
            attn_resolutions,
            dropout,
            channel_mult_noise,
            resample_filter,
        )

    # -- the noise levels the network supports (the sampler clips its schedule to them)

    def vp_sigma(self, t: torch.Tensor | float) -> torch.Tensor:
        t = torch.as_tensor(t, dtype=torch.float64)
        return ((0.5 * self.config.beta_d * t**2 + self.config.beta_min * t).exp() - 1).sqrt()

    @property
    def sigma_range(self) -> tuple[float, float]:
        cfg = self.config
        if cfg.precond == "vp":
            return float(self.vp_sigma(cfg.epsilon_t)), float(self.vp_sigma(1.0))
        low = 0.0 if cfg.sigma_min is None else cfg.sigma_min
        return low, math.inf if cfg.sigma_max is None else cfg.sigma_max

    def coefficients(self, sigma: torch.Tensor):
        """(c_skip, c_out, c_in, c_noise) of EDM Table 1 for σ [B, 1, 1, 1] (float32)."""
        cfg = self.config
        if cfg.precond == "vp":
            # c_noise = (M − 1)·t(σ), t(σ) the inverse of σ(t) above
            b0, bd = cfg.beta_min, cfg.beta_d
            t = ((b0**2 + 2 * bd * (1 + sigma**2).log()).sqrt() - b0) / bd
            return 1, -sigma, 1 / (sigma**2 + 1).sqrt(), (cfg.M - 1) * t
        sd = cfg.sigma_data
        c_skip = sd**2 / (sigma**2 + sd**2)
        c_out = sigma * sd / (sigma**2 + sd**2).sqrt()
        return c_skip, c_out, 1 / (sd**2 + sigma**2).sqrt(), sigma.log() / 4

    def forward(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor | float,
        class_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x.to(torch.float32)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1, 1, 1, 1)
        dtype = self.dtype
        labels = None
        if self.config.label_dim:
            if class_labels is None:
                raise ValueError("this EDM network is class-conditional: pass class_labels")
            labels = class_labels.to(torch.float32).reshape(-1, self.config.label_dim)
        c_skip, c_out, c_in, c_noise = self.coefficients(sigma)
        # only the image path runs in the weights' dtype; a scalar σ gives a [1, C] embedding
        # that broadcasts over the batch
        f = self.model((c_in * x).to(dtype), c_noise.flatten(), labels)
        return c_skip * x + c_out * f.to(torch.float32)

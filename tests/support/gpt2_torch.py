#!/usr/bin/env python3
"""PyTorch's side of the GPT-2 tests: a GPT2LMHeadModel written here with
Hugging Face's parameter names and Conv1D layouts (so no transformers
package is needed), fed from safetensors files the C tests write.

  gpt2_torch.py grad IN OUT N_HEAD
      IN holds every parameter by FQN plus "tokens" and "targets" (int32
      [B, T]); OUT receives "loss" (float64 scalar) and "grad.<fqn>" for
      every parameter (float32): the gradient of the mean cross-entropy.

  gpt2_torch.py train IN DATA OUT N_HEAD key=value ...
      IN: a FULL checkpoint (model.safetensors) to start from; DATA the
      byte corpus. Trains with torch.optim.AdamW on the batches of the
      documented rule (docs/gpt2.md) and writes "losses" (float64 [steps])
      and every parameter after the last step. Keys: steps, batch, seq,
      lr, beta1, beta2, eps, wd, clip (0: off), accum, schedule (constant
      or cosine), warmup, min_lr.

Exit status 0, 2 on bad input (message on stderr), 3 when torch is missing.
"""
import json
import math
import struct
import sys

try:
    import numpy as np
    import torch
    import torch.utils.checkpoint
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:  # the C test turns this into a skip
    sys.stderr.write("gpt2_torch.py: %s\n" % e)
    sys.exit(3)

DT = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64,
      "U8": np.uint8, "BOOL": np.bool_, "F16": np.float16, "BF16": np.uint16}


def st_read(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, t in head.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=DT[t["dtype"]]).reshape(t["shape"])
        if t["dtype"] == "BF16":  # widen: bfloat16 is float32's top half
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.copy()
    return out


def st_write(path, tensors):
    names = sorted(tensors)
    head, blobs, off = {}, [], 0
    for k in names:
        a = np.ascontiguousarray(tensors[k])
        code = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64"}[a.dtype]
        b = a.tobytes()
        head[k] = {"dtype": code, "shape": list(a.shape),
                   "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(head).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


class Conv1D(nn.Module):
    def __init__(self, nx, nf):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        shape = x.shape[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]),
                           self.weight).view(shape)


class Attention(nn.Module):
    def __init__(self, C, ctx, n_head):
        super().__init__()
        self.n_head = n_head
        self.register_buffer("bias", torch.tril(torch.ones(ctx, ctx,
                             dtype=torch.bool)).view(1, 1, ctx, ctx))
        self.register_buffer("masked_bias", torch.tensor(-1e4))
        self.c_attn = Conv1D(C, 3 * C)
        self.c_proj = Conv1D(C, C)

    def forward(self, x):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hs)
        mask = self.bias[:, :, :T, :T].bool()
        w = torch.where(mask, w, torch.tensor(torch.finfo(w.dtype).min))
        w = F.softmax(w, dim=-1)
        y = torch.matmul(w, v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) *
                                       (x + 0.044715 * torch.pow(x, 3.0))))


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.c_fc = Conv1D(C, 4 * C)
        self.c_proj = Conv1D(4 * C, C)

    def forward(self, x):
        return self.c_proj(gelu_new(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, C, ctx, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = Attention(C, ctx, n_head)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = MLP(C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Body(nn.Module):
    def __init__(self, V, C, ctx, L, n_head):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(ctx, C)
        self.h = nn.ModuleList([Block(C, ctx, n_head) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C, eps=1e-5)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, V, C, ctx, L, n_head, checkpointing=False):
        super().__init__()
        self.transformer = Body(V, C, ctx, L, n_head)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        # each block recomputed in backward from its input, as FSDP's
        # checkpoint_wrapper does (shardplane's --activation-checkpointing)
        self.checkpointing = checkpointing

    def forward(self, tok, tgt):
        t = self.transformer
        pos = torch.arange(tok.shape[1])
        x = t.wte(tok) + t.wpe(pos)
        for b in t.h:
            if self.checkpointing:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        logits = self.lm_head(t.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]),
                               tgt.reshape(-1))


def build(tensors, n_head):
    wte = tensors["transformer.wte.weight"]
    wpe = tensors["transformer.wpe.weight"]
    L = 0
    while "transformer.h.%d.ln_1.weight" % L in tensors:
        L += 1
    m = GPT2LMHeadModel(wte.shape[0], wte.shape[1], wpe.shape[0], L, n_head)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name not in tensors:
                sys.exit("gpt2_torch.py: %s is not in the input" % name)
            p.copy_(torch.from_numpy(tensors[name].astype(np.float32)))
        for name, b in m.named_buffers():
            if name in tensors:
                b.copy_(torch.from_numpy(tensors[name]).to(b.dtype).view(b.shape))
    return m


def grad(inp, out, n_head):
    t = st_read(inp)
    m = build(t, n_head)
    tok = torch.from_numpy(t["tokens"].astype(np.int64))
    tgt = torch.from_numpy(t["targets"].astype(np.int64))
    loss = m(tok, tgt)
    loss.backward()
    res = {"loss": np.array(loss.item(), dtype=np.float64)}
    for name, p in m.named_parameters():
        res["grad." + name] = p.grad.numpy().astype(np.float32)
    st_write(out, res)


MASK = (1 << 64) - 1


def mix64(z):
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def window(step, sample):
    return mix64(mix64(step ^ 0x53504750543200) ^ sample)


def lr_at(c, t):
    if c["schedule"] == "constant":
        return c["lr"]
    w, T = int(c["warmup"]), int(c["steps"])
    if t < w:
        return c["lr"] * (t + 1) / w
    if t >= T:
        return c["min_lr"]
    return c["min_lr"] + 0.5 * (c["lr"] - c["min_lr"]) * (
        1 + math.cos(math.pi * (t - w) / (T - w)))


def train(inp, data_path, out, n_head, kv):
    c = {"steps": 20, "batch": 8, "seq": 64, "lr": 1e-3, "beta1": 0.9,
         "beta2": 0.999, "eps": 1e-8, "wd": 0.01, "clip": 0.0, "accum": 1,
         "schedule": "constant", "warmup": 0, "min_lr": 0.0}
    for a in kv:
        k, v = a.split("=", 1)
        if k not in c:
            sys.exit("gpt2_torch.py: unknown key %s" % k)
        c[k] = v if k == "schedule" else float(v)
    m = build(st_read(inp), n_head)
    with open(data_path, "rb") as f:
        data = np.frombuffer(f.read(), dtype=np.uint8)
    n_train = len(data) - len(data) // 10
    T, steps, batch, k = int(c["seq"]), int(c["steps"]), int(c["batch"]), int(c["accum"])
    decay = [p for p in m.parameters() if p.dim() >= 2]
    rest = [p for p in m.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c["wd"]},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=c["lr"], betas=(c["beta1"], c["beta2"]),
                            eps=c["eps"])
    losses = []
    micro = batch // k
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(c, s)
        opt.zero_grad()
        total = 0.0
        for j in range(k):
            tok = np.zeros((micro, T), dtype=np.int64)
            tgt = np.zeros((micro, T), dtype=np.int64)
            for q in range(micro):
                st = window(s, j * micro + q) % (n_train - T)
                tok[q] = data[st:st + T]
                tgt[q] = data[st + 1:st + T + 1]
            loss = m(torch.from_numpy(tok), torch.from_numpy(tgt)) / k
            loss.backward()
            total += loss.item()
        losses.append(total)
        if c["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(m.parameters(), c["clip"])
        opt.step()
    res = {"losses": np.array(losses, dtype=np.float64)}
    for name, p in m.named_parameters():
        res[name] = p.detach().numpy().astype(np.float32)
    st_write(out, res)


def main():
    # one thread: the tests run beside others, and one thread's sums are
    # reproducible
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if len(sys.argv) >= 5 and sys.argv[1] == "grad":
        grad(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) >= 6 and sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]),
              sys.argv[6:])
    else:
        sys.stderr.write(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes a shardplane.model/v1 spec of a GPT-2-family model with Hugging
Face GPT2LMHeadModel names, shapes and Conv1D layouts ([in, out]).

  scripts/gpt2_spec.py NAME N_LAYER N_EMBD N_HEAD N_CTX VOCAB > spec.json

examples/models/gpt2-tiny.json and gpt2-mini.json were written with it.
Buffers are those of the transformers 4.2x GPT2Attention (a bool causal
mask "bias" [1, 1, ctx, ctx] and a float scalar "masked_bias");
lm_head.weight is tied to transformer.wte.weight. "config" carries what
the shapes do not say (the number of heads), as HF's config.json does.
"no_split_modules" is HF's GPT2PreTrainedModel._no_split_modules (the
blocks, which the tools' default wrap policy then wraps as units), and
"training" the AdamW recipe of GPT-2 124M in nanoGPT and llm.c (TRAINING
below), the defaults of the training flags of the same names.
"""
import json
import sys

# nanoGPT's and llm.c's GPT-2 124M: peak 6e-4, linear warmup then cosine
# decay to a tenth of it, AdamW (0.9, 0.95), eps 1e-8, decoupled weight
# decay 0.1, gradients clipped at norm 1.0. Warmup as a fraction of the
# run's steps (llm.c warms up over 700 of its ~19k steps): a spec cannot
# know how long a run is, and a fixed count longer than a short run would
# leave it warming up only.
TRAINING = {"optimizer": "adamw", "lr": 6e-4, "betas": [0.9, 0.95],
            "eps": 1e-8, "weight_decay": 0.1, "lr_schedule": "cosine",
            "warmup_ratio": 0.04, "min_lr": 6e-5, "clip_grad_norm": 1.0}


def spec(name, n_layer, d, n_head, ctx, vocab):
    mods = [("", "GPT2LMHeadModel"), ("transformer", "GPT2Model"),
            ("transformer.wte", "Embedding"), ("transformer.wpe", "Embedding"),
            ("transformer.drop", "Dropout"), ("transformer.h", "ModuleList")]
    params = [("transformer.wte.weight", [vocab, d]),
              ("transformer.wpe.weight", [ctx, d])]
    buffers = []
    for i in range(n_layer):
        h = "transformer.h.%d" % i
        mods += [(h, "GPT2Block"), (h + ".ln_1", "LayerNorm"),
                 (h + ".attn", "GPT2Attention"),
                 (h + ".attn.c_attn", "Conv1D"), (h + ".attn.c_proj", "Conv1D"),
                 (h + ".attn.attn_dropout", "Dropout"),
                 (h + ".attn.resid_dropout", "Dropout"),
                 (h + ".ln_2", "LayerNorm"), (h + ".mlp", "GPT2MLP"),
                 (h + ".mlp.c_fc", "Conv1D"), (h + ".mlp.c_proj", "Conv1D"),
                 (h + ".mlp.act", "NewGELUActivation"),
                 (h + ".mlp.dropout", "Dropout")]
        params += [(h + ".ln_1.weight", [d]), (h + ".ln_1.bias", [d]),
                   (h + ".attn.c_attn.weight", [d, 3 * d]),
                   (h + ".attn.c_attn.bias", [3 * d]),
                   (h + ".attn.c_proj.weight", [d, d]),
                   (h + ".attn.c_proj.bias", [d]),
                   (h + ".ln_2.weight", [d]), (h + ".ln_2.bias", [d]),
                   (h + ".mlp.c_fc.weight", [d, 4 * d]),
                   (h + ".mlp.c_fc.bias", [4 * d]),
                   (h + ".mlp.c_proj.weight", [4 * d, d]),
                   (h + ".mlp.c_proj.bias", [d])]
        buffers += [(h + ".attn.bias", [1, 1, ctx, ctx], "bool"),
                    (h + ".attn.masked_bias", [], "float32")]
    mods += [("transformer.ln_f", "LayerNorm"), ("lm_head", "Linear")]
    params += [("transformer.ln_f.weight", [d]), ("transformer.ln_f.bias", [d])]
    return {
        "format": "shardplane.model/v1",
        "name": name,
        "source": "GPT-2 family, %d layers, d_model %d, %d heads, context %d, "
                  "vocab %d (byte-level); names and Conv1D layouts as Hugging "
                  "Face transformers GPT2LMHeadModel; written by "
                  "scripts/gpt2_spec.py" % (n_layer, d, n_head, ctx, vocab),
        "config": {"n_layer": n_layer, "n_embd": d, "n_head": n_head,
                   "n_positions": ctx, "vocab_size": vocab},
        "no_split_modules": ["GPT2Block"],
        "training": TRAINING,
        "modules": [{"fqn": f, "type": t} for f, t in mods],
        "params": [{"fqn": f, "shape": s, "dtype": "float32",
                    "requires_grad": True} for f, s in params],
        "buffers": [{"fqn": f, "shape": s, "dtype": t, "persistent": True}
                    for f, s, t in buffers],
        "tied": [{"fqn": "lm_head.weight", "to": "transformer.wte.weight"}],
    }


def main():
    if len(sys.argv) != 7:
        sys.exit(__doc__)
    name = sys.argv[1]
    n = [int(a) for a in sys.argv[2:]]
    if n[1] % n[2]:
        sys.exit("gpt2_spec.py: N_EMBD %d is not a multiple of N_HEAD %d"
                 % (n[1], n[2]))
    json.dump(spec(name, *n), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

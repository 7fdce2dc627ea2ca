"""Fine-tune a Hugging Face GPT-2 and hand it back as a folder Hugging Face and serving engines
read: a tiny character-level GPT-2 (random, made with ``transformers`` and written by its
``save_pretrained``, as a downloaded one would be) is loaded into a Flax GPT-2 with Hugging Face's
module names, fine-tuned on the Zen of Python (shipped with Python: ``import this``), and written
by ``trainer.save_pretrained``; ``transformers``' ``from_pretrained`` then gives trainkit's logits
and ``generate`` trainkit's greedy continuation.

    python examples/serve_gpt2.py                 # 8 fake CPU devices, FSDP
    python examples/serve_gpt2.py --epochs 40 --lora   # LoRA adapters, written as a PEFT folder too

Needs ``transformers`` and torch (``peft`` for ``--lora``). docs/finetuning.md explains each step.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import os
import sys
import tempfile


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--devices", type=int, default=8, help="fake this many CPU devices (0: the real devices)")
    parser.add_argument("--epochs", type=int, default=30, help="fine-tuning epochs over the text's windows")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (rank 4) instead of every weight")
    parser.add_argument("--prompt", default="Beautiful is", help="what both decoders continue")
    parser.add_argument("--out", default=None, help="where the folders go (default: a new temp dir)")
    return parser.parse_args(argv)


def zen() -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # importing it prints it
        import this  # noqa: F401  (its text, rot13, is this.s)

    return codecs.decode(sys.modules["this"].s, "rot13")


def gpt2_module(vocab: int, positions: int, width: int, layers: int, heads: int):
    """GPT-2 in Flax, its modules named as Hugging Face's ``GPT2LMHeadModel`` names them (the head tied to ``wte``)."""
    import flax.linen as nn
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            (b, t, w), per_head = x.shape, x.shape[-1] // heads
            h = nn.LayerNorm(1e-5, name="ln_1")(x)
            q, k, v = (
                a.reshape(b, t, heads, per_head) for a in jnp.split(nn.Dense(3 * w, name="attn_c_attn")(h), 3, -1)
            )
            attended = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((b, t))))
            x = x + nn.Dense(w, name="attn_c_proj")(attended.reshape(b, t, w))
            h = nn.gelu(nn.Dense(4 * w, name="mlp_c_fc")(nn.LayerNorm(1e-5, name="ln_2")(x)))  # tanh gelu: gelu_new
            return x + nn.Dense(w, name="mlp_c_proj")(h)

    class GPT2(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            wte = nn.Embed(vocab, width, name="wte")
            x = wte(tokens) + nn.Embed(positions, width, name="wpe")(jnp.arange(tokens.shape[-1]))
            for i in range(layers):
                x = Block(name=f"h_{i}")(x)
            return wte.attend(nn.LayerNorm(1e-5, name="ln_f")(x))

    return GPT2()


#: Hugging Face's names in (``transformer.h.0.attn.c_attn.weight`` -> ``h_0/attn_c_attn/kernel``) and out
NAMES_IN = [(r"^transformer\.h\.(\d+)\.(attn|mlp)\.", r"h_\1.\2_"), (r"^transformer\.h\.(\d+)\.", r"h_\1."),
            (r"^transformer\.", "")]  # fmt: skip
NAMES_OUT = [(r"^h_(\d+)/(attn|mlp)_", r"transformer.h.\1.\2."), (r"^h_(\d+)/", r"transformer.h.\1."),
             (r"^(wte|wpe|ln_f)/", r"transformer.\1/"), (r"/(kernel|scale|embedding)$", ".weight"),
             (r"/", ".")]  # fmt: skip
CONV1D = [r"\.c_(attn|proj|fc)\.weight$"]  # GPT-2's Conv1D stores (in, out), as Flax does


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.devices:  # fake CPU devices: before JAX is imported
        os.environ.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(args.devices))
    import numpy as np
    import optax
    import torch
    import transformers

    import trainkit as tk

    text = zen()
    chars = sorted(set(text))
    encode = lambda s: np.array([chars.index(c) for c in s], np.int32)  # noqa: E731
    decode = lambda ids: "".join(chars[i] for i in ids)  # noqa: E731
    ids, window = encode(text), 64
    starts = np.arange(0, len(ids) - window - 1, 8)
    rows = np.stack([ids[s : s + window + 1] for s in starts])  # each window and its next characters

    out = args.out or tempfile.mkdtemp(prefix="serve-gpt2-")
    base = os.path.join(out, "base")
    config = transformers.GPT2Config(vocab_size=len(chars), n_positions=window, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=None, eos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(base)  # as a downloaded checkpoint is

    options = {"lora": tk.LoRA(rank=4, alpha=8, targets="attn|mlp")} if args.lora else {}
    gpt2 = tk.Trainer(gpt2_module(len(chars), window, 64, 2, 4), loss="sparse_categorical_crossentropy",
                      optimizer=optax.adamw(3e-3), strategy=tk.FSDP(min_shard_size=1024), **options)  # fmt: skip
    gpt2.init(rows[:8, :-1])
    report = tk.weights.load(base, into=gpt2, layout="torch", rename=NAMES_IN, as_is=CONV1D)
    print(f"loaded {len(report.loaded)} tensors from {base}")
    history = gpt2.fit(rows[:, :-1], rows[:, 1:], batch_size=16, epochs=args.epochs, verbose=0)
    print(f"fine-tuned {args.epochs} epochs on {len(rows)} windows: loss {history.history['loss'][0]:.3f} -> "
          f"{history.history['loss'][-1]:.3f}")  # fmt: skip

    served = os.path.join(out, "served")
    gpt2.save_pretrained(served, config=base, rename=NAMES_OUT)
    print(f"save_pretrained wrote {', '.join(sorted(os.listdir(served)))}")
    read = transformers.AutoModelForCausalLM.from_pretrained(served).eval()
    sample = rows[:8, :-1]
    with torch.no_grad():
        theirs = read(torch.from_numpy(sample.astype(np.int64))).logits.numpy()
    difference = float(np.abs(gpt2.predict(sample, verbose=0) - theirs).max())
    print(f"from_pretrained's logits against trainkit's: max difference {difference:.1e}")

    prompt = encode(args.prompt)
    tokens = list(prompt)
    for _ in range(window - len(prompt)):  # trainkit's greedy decode over the whole causal window
        padded = np.zeros((8, window), np.int32)
        padded[:, : len(tokens)] = tokens
        tokens.append(int(np.argmax(gpt2.predict(padded, verbose=0)[0, len(tokens) - 1])))
    with torch.no_grad():
        generated = read.generate(torch.from_numpy(prompt[None].astype(np.int64)), do_sample=False,
                                  max_new_tokens=window - len(prompt))[0].tolist()  # fmt: skip
    print(f"trainkit greedy:     {decode(tokens)!r}")
    print(f"transformers greedy: {decode(generated)!r}")
    same = generated == tokens
    print(f"the same tokens: {same}")
    if args.lora:
        import peft

        adapter = os.path.join(out, "adapter")
        gpt2.save_pretrained(adapter, config=base, rename=NAMES_OUT, adapter=True)
        adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter)
        with torch.no_grad():
            peft_logits = adapted.eval()(torch.from_numpy(sample.astype(np.int64))).logits.numpy()
        print(f"PEFT folder ({', '.join(sorted(os.listdir(adapter)))}): logits max difference "
              f"{float(np.abs(peft_logits - theirs).max()):.1e}")  # fmt: skip
    return 0 if same and difference < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Write a small random-weight llama-architecture GGUF model that llama-server can serve,
with no download.

    python build_tiny_gguf.py SHARE_DIR OUT.gguf [--preset tiny|slow]

SHARE_DIR is `.ci/install-llamacpp.sh`'s `$DEST/share/llama.cpp` (or a llama.cpp source
tree), which provides:

* `gguf-py/`, llama.cpp's own pure-Python GGUF writer and reader;
* `models/ggml-vocab-llama-spm.gguf`, a vocabulary-only GGUF: every `tokenizer.*` field
  (the 32000-token SentencePiece Llama vocabulary, bos 1, eos 2) is copied from it.

Needs python3 and numpy only. gguf-py's package `__init__` imports PyYAML for model-card
metadata that is never used here; where PyYAML is missing a stub module stands in.

Presets (seeded weights: the output is byte-for-byte reproducible):

* `tiny`: n_embd 64, 2 layers, 4 heads, n_ff 192, n_ctx_train 4096, f16, about 5 MB;
  thousands of tokens per second on one core.
* `slow`: n_embd 512, 8 layers, 8 heads, n_ff 1536, n_ctx_train 8192, f16, about 88 MB;
  about 180 generated tokens per second on one core, and a 512-token prompt chunk takes
  a few hundred milliseconds, so "busy" lasts seconds. The live tests use this one.

The output projection is tied to `token_embd` (llama.cpp's llama architecture allows it).
The file is written to OUT.gguf.tmp and renamed, so a half-written model is never used.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from typing import Any

PRESETS = {
    "tiny": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_head_kv": 4, "n_ff": 192, "ctx": 4096},
    "slow": {"n_embd": 512, "n_layer": 8, "n_head": 8, "n_head_kv": 8, "n_ff": 1536, "ctx": 8192},
}
VOCAB_FILE = os.path.join("models", "ggml-vocab-llama-spm.gguf")


def import_gguf(share_dir: str) -> Any:
    gguf_py = os.path.join(share_dir, "gguf-py")
    if not os.path.isdir(os.path.join(gguf_py, "gguf")):
        sys.exit(f"build_tiny_gguf: no gguf-py package under {gguf_py}")
    sys.path.insert(0, gguf_py)
    try:
        import yaml  # noqa: F401
    except ImportError:
        sys.modules["yaml"] = types.ModuleType("yaml")  # only gguf.metadata uses it
    import gguf  # type: ignore[import-not-found]

    return gguf


def build(share_dir: str, out: str, preset: str = "tiny", seed: int = 1234) -> int:
    """Write the model; returns its size in bytes."""
    import numpy as np

    gguf = import_gguf(share_dir)
    hp = PRESETS[preset]
    n_embd, n_layer, n_head, n_head_kv, n_ff, ctx = (hp[k] for k in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "ctx"))
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv

    reader = gguf.GGUFReader(os.path.join(share_dir, VOCAB_FILE))
    tok_fields = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    n_vocab = len(tok_fields["tokenizer.ggml.tokens"].data)

    tmp = out + ".tmp"
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(f"llm-health random llama ({preset})")
    w.add_description("Random weights, for exercising llama-server in llm-health's tests only. Generated offline.")
    w.add_context_length(ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(1)  # LLAMA_FTYPE_MOSTLY_F16

    vt = gguf.GGUFValueType
    for key, f in tok_fields.items():
        if f.types[0] == vt.ARRAY:
            w.add_key_value(key, f.contents(), vt.ARRAY, sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), f.types[0])

    # numpy shapes are ggml's ne[] reversed: (rows = out features, cols = in features)
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, std: float = 0.02) -> Any:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16)

    def ones(n: int) -> Any:
        return np.ones((n,), dtype=np.float32)

    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd, 1.0 / float(np.sqrt(n_embd))))
    w.add_tensor("output_norm.weight", ones(n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(n_embd))
        w.add_tensor(p + "attn_q.weight", mat(n_embd, n_embd))
        w.add_tensor(p + "attn_k.weight", mat(n_embd_kv, n_embd))
        w.add_tensor(p + "attn_v.weight", mat(n_embd_kv, n_embd))
        w.add_tensor(p + "attn_output.weight", mat(n_embd, n_embd))
        w.add_tensor(p + "ffn_norm.weight", ones(n_embd))
        w.add_tensor(p + "ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", mat(n_embd, n_ff))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return os.path.getsize(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("share_dir", help="directory with gguf-py/ and models/ggml-vocab-llama-spm.gguf")
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)
    size = build(a.share_dir, a.out, a.preset, a.seed)
    print(f"build_tiny_gguf: wrote {a.out}: {size / 1e6:.1f} MB, preset {a.preset}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build a tiny random-weight Llama model that vLLM can serve, with no download.

Run with the vLLM venv's python (needs torch, transformers, tokenizers):

    python build_tiny_model.py OUT_DIR

Writes config.json, model.safetensors, a byte-level BPE tokenizer trained on the
local license texts (bos/eos/unk/pad and a chat template), then a marker file last.
Deterministic (fixed seed). ~5 s, ~3 MB.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import tempfile

MARKER = ".llm-health-model-complete"
VOCAB_SIZE = 2048
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_files() -> list[str]:
    files = sorted(f for f in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(f))
    if not files:  # any text will do; fall back to Python's own sources
        import json as _j

        files = [_j.__file__]
    return files


def build(out_dir: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(1234)
    specials = ["<s>", "</s>", "<unk>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE

    vocab = len(fast)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: vLLM's CPU attention needs >= 32
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.eval()

    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-llama-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        fast.save_pretrained(tmp)
        gen = {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id, "pad_token_id": fast.pad_token_id}
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(gen, f)
        with open(os.path.join(tmp, MARKER), "w") as f:
            f.write(f"vocab={vocab} hidden=128 layers=2 heads=4\n")
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = argv[1]
    if os.path.exists(os.path.join(out, MARKER)):
        print(f"tiny model already at {out}")
        return 0
    build(out)
    print(f"tiny model built at {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

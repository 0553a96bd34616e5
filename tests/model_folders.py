"""Model folders a new user would point the lab at, made offline: a randomly initialised
Qwen2, Llama or GPT-2 with a byte-level BPE tokenizer trained on the arithmetic task's text
and saved with `save_pretrained` (no download)."""

from pathlib import Path


def bpe_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on sums and boxed answers: its merges make
    multi-character tokens ('Ġ', '\\boxed{' pieces, two-digit numbers) no character-level
    vocabulary has."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    text = [f"{a}+{b}= {a}+{b} is \\boxed{{{a + b}}}" for a, b in
            ((rng.randrange(100), rng.randrange(100)) for _ in range(2000))]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>",
                                                                          "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def save_random(folder: Path, arch: str = "qwen2") -> Path:
    """A random `arch` (qwen2, llama, gpt2) of two small layers and the BPE tokenizer, saved
    into `folder`."""
    import torch
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    tokenizer = bpe_tokenizer()
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                           **ids))
    else:
        kind = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
        model = kind[1](kind[0](hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=256, tie_word_embeddings=True, **ids))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder

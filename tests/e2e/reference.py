"""Checks shared by the real-weight tests (the reference: HF transformers on the same GGUF file)."""
import torch

import jaxmodels as jm


def assert_greedy_matches_hf(ours, hf_model, hf_tok, prompt_text: str, n_new: int) -> None:
    """n_new greedy tokens of ours (generate, EOS ignored) equal HF generate's, ids and decoded text."""
    out = jm.generate(ours, [prompt_text], max_new_tokens=n_new, ignore_eos=True)
    prompt = out.prompt_tokens[0]
    assert prompt == hf_tok(prompt_text)["input_ids"]
    ids = torch.as_tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        want = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=False, pad_token_id=hf_tok.pad_token_id)
    want = want[0, len(prompt):].tolist()
    assert len(want) == n_new
    assert out.tokens[0] == want, (f"ours: {ours.tokenizer.decode(out.tokens[0])!r}\n"
                                   f"HF:   {ours.tokenizer.decode(want)!r}")
    assert out.texts[0] == hf_tok.decode(want, skip_special_tokens=True)

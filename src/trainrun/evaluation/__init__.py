"""What was trained, loaded, scored and generated from: ``language_model.py`` (``trainrun.load``:
a run, a Hugging Face or an adapter directory as a model to call), ``text_tokens.py`` (its
tokenizer), ``sample.py`` (``trainrun sample``: text and chat answers), ``evaluate.py``
(``trainrun eval``: the held-out loss and answers) and ``harness.py`` (the lm-evaluation-harness
model ``trainrun`` and ``trainrun lm-eval``)."""

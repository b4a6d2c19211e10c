"""`liger-kd serve`, the server application: a Hugging Face causal LM served as a teacher (top-k log-probs,
sampled tokens, hidden states and head) and as the student's rollout engine (generation, LoRA adapters, weight
updates from disk or by broadcast). app.py builds it (FastAPI and uvicorn, imported lazily: the optional extra
`serve`); the formats it writes are the wire room's (liger_patch_kd/wire/). Nothing is imported here, so importing
one module of the server imports no web framework, and the client side (teacher/client/) never imports this room."""

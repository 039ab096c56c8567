"""Model families (`gpt`, `llama`), the layers they share, and what the trainer asks of a
model (`model.py`): initial params, the loss, sizes, FLOPs and memory."""

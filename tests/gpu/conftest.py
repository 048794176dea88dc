import os

# Real-width DeepSeek layers fill an 80 GB card. On an H100 (2026-12-07) the speculating-engine test failed after
# the 4.5e9-byte kernel cases in the same process (its message was lost) and passed alone: JAX's default pool of
# 75 % is the suspect, not shown. Read when the backend starts (the first test that touches a device).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

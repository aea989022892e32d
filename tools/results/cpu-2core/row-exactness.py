"""The engine issue's reproduction of the int8 export's exactness defect, run natively and on an emulated AVX2 CPU
(tools/results/cpu-2core/row-exactness.md).

    python tools/results/cpu-2core/row-exactness.py EXPORT [NEW_TOKENS]
    qemu-x86_64 -cpu EPYC-Rome .venv/bin/python tools/results/cpu-2core/row-exactness.py EXPORT [NEW_TOKENS]

Loads EXPORT (timing the load with the row-exactness probe: set XDG_CACHE_HOME to an empty folder so that it
probes), then decodes the issue's chat prompt with `ar`, ParaDecode's defaults and ParaDecode without lookup.
"""

import logging
import sys
import time

from paradecode.runtime import load

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
PROMPT = (
    "Translate German to English: Pfandhäuser boomen in Singapur , da die Krise in der Mittelschicht angekommen ist"
)

began = time.perf_counter()
model = load(sys.argv[1])
form = getattr(model.backend, "row_form", "(no probe in this version)")
print(f"load with the probe {time.perf_counter() - began:.2f} s; form {form}")
messages = [{"role": "user", "content": PROMPT}]
new_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 64
ar = model.generate(messages=messages, max_new_tokens=new_tokens, mode="ar")
print("ar:", repr(ar.text))
for settings in ({}, {"lookup_tokens": 0}):
    ours = model.generate(messages=messages, max_new_tokens=new_tokens, **settings)
    print("paradecode", settings, repr(ours.text), "EQUAL" if ours.token_ids == ar.token_ids else "DIFFERENT")

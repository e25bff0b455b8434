"""Data: VLM-R1-style source YAMLs, record formats, seeded sampling, and the generated demo dataset."""

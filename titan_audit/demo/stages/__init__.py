"""The demo's stages, one module per guarantee: train.py (the two training runs the others
compare), elastic.py (G3 and its control), kill_resume.py (G5), zero_gap.py (G4),
batch_invariance.py (G2), goldens.py (G1). A stage is a function of the `Demo` (demo/runner.py)
that adds verdict rows; a check it cannot make because a stage it needs failed is a FAIL row that
says so."""

"""What is durable: the files of record and what they say.

- ``writer.py``: the row writer (group commit, fsync), the run lock, atomic JSON;
- ``resume.py``: the resume contract and its one finality rule, read back
  from the output files alone (a torn tail is repaired first);
- ``contracts.py``: the JSON several modules read (manifest, job status,
  failure-row keys), typed once;
- ``delivery_history.py``: the manifest's per-hop delivery record;
- ``gym_compat.py``: NeMo Gym's names for the same files.
"""

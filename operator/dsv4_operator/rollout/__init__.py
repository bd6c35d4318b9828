"""Rolling updates of the engine instances from one revision to the next (``plan``, pure; the
revision itself is ``reconcile/revision.py``)."""

"""The parts of bench/torture_checkpoint.py: the expected content, the child that saves
and is killed, the checker, the driver that plans and counts the kills."""

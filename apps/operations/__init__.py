"""Actions: the audit log of every change to the world, and their Celery execution."""

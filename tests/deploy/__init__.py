"""Validation tests of deploy/: manifests, alert rules, dashboard, Dockerfile."""

"""The launcher layer: ``ds-run`` and ``ds_report``. Never imports torch (see DESIGN.md)."""

"""The plugin's entry point for a `vllm serve` that imports the project from its source tree (the H200 site)."""

import importlib.metadata

from bench.e2e import gpu_site


def test_written_metadata_names_the_plugins_entry_point(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])  # as on the site: not installed
    assert gpu_site.plugin_metadata_dir(tmp_path) == tmp_path
    monkeypatch.undo()
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    assert dist.metadata["Name"] == "vllm-treewy"
    (entry,) = dist.entry_points.select(group="vllm.general_plugins")
    import vllm_treewy.vllm_plugin

    assert entry.load() is vllm_treewy.vllm_plugin.register


def test_nothing_written_where_the_project_is_installed(tmp_path):
    # The test environment installs the project (`make install`), entry points included.
    assert gpu_site.plugin_metadata_dir(tmp_path) is None
    assert not any(tmp_path.iterdir())

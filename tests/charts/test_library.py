"""The templates every service chart shares live once, in the library chart tessera-lib; each
service chart depends on it and only binds its component."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from test_charts import SERVICE_CHARTS, charts_dir, render  # noqa: F401 - the fixture

CHARTS = Path(__file__).resolve().parents[2] / "charts"
BINDING = re.compile(
    r'^\{\{- define "(?P<chart>[a-z-]+)\.(?P<name>\w+)" -\}\}'
    r'\{\{ include "tessera-lib\.(?P=name)" \(dict "root" \. "component" "(?P<component>[a-z-]+)"'
    r'( "nodeIdentity" true)?\) \}\}\{\{- end -\}\}$')


def test_the_library_is_a_library_chart() -> None:
    chart = yaml.safe_load((CHARTS / "tessera-lib" / "Chart.yaml").read_text())
    assert chart["type"] == "library"
    defined = re.findall(r'define "(tessera-lib\.\w+)"',
                         (CHARTS / "tessera-lib/templates/_tessera.tpl").read_text())
    assert len(defined) == len(set(defined)) >= 10


def test_every_service_chart_depends_on_it_and_keeps_only_bindings(charts_dir) -> None:  # noqa: F811
    library = set(re.findall(r'define "tessera-lib\.(\w+)"',
                             (CHARTS / "tessera-lib/templates/_tessera.tpl").read_text()))
    for chart in SERVICE_CHARTS:
        meta = yaml.safe_load((CHARTS / chart / "Chart.yaml").read_text())
        assert {"name": "tessera-lib", "version": "0.1.0",
                "repository": "file://../tessera-lib"} in meta["dependencies"], chart
        # Each shared template is bound, in one line, to the library's; a chart may define
        # templates of its own besides, but no copy of a shared one.
        bound = set()
        for path in (CHARTS / chart / "templates").glob("*.tpl"):
            for line in path.read_text().splitlines():
                define = re.match(rf'\{{\{{-? define "{chart}\.(\w+)"', line)
                if not define or define.group(1) not in library:
                    continue
                match = BINDING.match(line)
                assert match, f"{path.name} defines {define.group(1)} itself: {line}"
                assert match["chart"] == chart
                assert match["component"] == chart.removeprefix("tessera-")
                bound.add(match["name"])
        assert bound == library, chart
        # Rendered, the component is the chart's.
        for m in render(charts_dir, chart):
            labels = m["metadata"]["labels"]
            assert labels["app.kubernetes.io/component"] == chart.removeprefix("tessera-")

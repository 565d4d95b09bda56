"""The dashboard's panels, one module each. Every panel receives plain snapshots and values from
the app and owns its own rendering; none of them holds or calls the engine."""

from tui.widgets.blockmap import BlockMap
from tui.widgets.charts import Charts
from tui.widgets.eventlog import EventLog
from tui.widgets.header import HeaderInfo, StatusHeader
from tui.widgets.help import HelpScreen
from tui.widgets.inject_dialog import InjectDialog, InjectSpec
from tui.widgets.instances import InstanceRows
from tui.widgets.queues import RequestTable

__all__ = ["BlockMap", "Charts", "EventLog", "HeaderInfo", "StatusHeader", "HelpScreen",
           "InjectDialog", "InjectSpec", "InstanceRows", "RequestTable"]

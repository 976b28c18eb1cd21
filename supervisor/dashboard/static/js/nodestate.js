// What the page calls a node: its status as the API says it (lost, failed, draining,
// cordoned, spare, running, ...) and the group it is counted in.

/** Groups, most urgent first: the order of the counts, the grid and the list. */
export const GROUPS = ["failed", "suspect", "cordoned", "spare", "healthy"];

export const GROUP_LABEL = {
  failed: "Failed",
  suspect: "Suspect",
  cordoned: "Cordoned",
  spare: "Spare",
  healthy: "Healthy",
};

/** The group a node counts in: failed (lost or failed), cordoned (or draining), suspect
 * (a mark: flapping, a late heartbeat, a straggler, a GPU error), spare, healthy. */
export function groupOf(node, extra = {}) {
  if (node.status === "lost" || node.status === "failed") return "failed";
  if (node.status === "cordoned" || node.status === "draining") return "cordoned";
  if (node.marks.length || extra.straggler || extra.gpu) return "suspect";
  if (node.status === "spare") return "spare";
  return "healthy";
}

/** Sort key: most urgent group first, then by name. */
export function rank(group) {
  return GROUPS.indexOf(group);
}

/** Cell colours of the compact grid (the same as the CSS variables). */
export const GROUP_COLOR = {
  failed: "#b42318",
  suspect: "#d97706",
  cordoned: "#7c3aed",
  spare: "#0a58ca",
  healthy: "#1a7f37",
};

//! Maximum flow / minimum cut (Dinic's algorithm) for the partitioner.

use std::collections::VecDeque;

/// Capacity meaning "never cut this edge".
pub const INF: u64 = u64::MAX / 4;

struct Edge {
    to: usize,
    cap: u64,
}

pub struct FlowNet {
    edges: Vec<Edge>,
    adj: Vec<Vec<usize>>,
}

impl FlowNet {
    pub fn new(nodes: usize) -> Self {
        FlowNet {
            edges: Vec::new(),
            adj: vec![Vec::new(); nodes],
        }
    }

    pub fn add_edge(&mut self, from: usize, to: usize, cap: u64) {
        self.adj[from].push(self.edges.len());
        self.edges.push(Edge { to, cap });
        self.adj[to].push(self.edges.len());
        self.edges.push(Edge { to: from, cap: 0 });
    }

    fn levels(&self, s: usize) -> Vec<u32> {
        let mut level = vec![u32::MAX; self.adj.len()];
        level[s] = 0;
        let mut q = VecDeque::from([s]);
        while let Some(u) = q.pop_front() {
            for &e in &self.adj[u] {
                let v = self.edges[e].to;
                if self.edges[e].cap > 0 && level[v] == u32::MAX {
                    level[v] = level[u] + 1;
                    q.push_back(v);
                }
            }
        }
        level
    }

    /// One blocking-flow augmentation along level-increasing edges (iterative, to keep deep graphs off
    /// the call stack). Returns the flow pushed.
    fn augment(&mut self, s: usize, t: usize, level: &[u32], next: &mut [usize]) -> u64 {
        let mut path: Vec<usize> = Vec::new(); // edge ids from s
        let mut u = s;
        loop {
            if u == t {
                let f = path.iter().map(|&e| self.edges[e].cap).min().unwrap_or(0);
                for &e in &path {
                    self.edges[e].cap -= f;
                    self.edges[e ^ 1].cap += f;
                }
                return f;
            }
            let mut advanced = false;
            while next[u] < self.adj[u].len() {
                let e = self.adj[u][next[u]];
                let v = self.edges[e].to;
                if self.edges[e].cap > 0 && level[v] == level[u].wrapping_add(1) {
                    path.push(e);
                    u = v;
                    advanced = true;
                    break;
                }
                next[u] += 1;
            }
            if !advanced {
                // dead end: retreat one step and skip the edge that led here
                let Some(e) = path.pop() else { return 0 };
                u = self.edges[e ^ 1].to;
                next[u] += 1;
            }
        }
    }

    /// Runs max flow from `s` to `t`; returns its value.
    pub fn max_flow(&mut self, s: usize, t: usize) -> u64 {
        let mut flow = 0u64;
        loop {
            let level = self.levels(s);
            if level[t] == u32::MAX {
                return flow;
            }
            let mut next = vec![0; self.adj.len()];
            loop {
                let f = self.augment(s, t, &level, &mut next);
                if f == 0 {
                    break;
                }
                flow = flow.saturating_add(f);
                if flow >= INF {
                    return flow;
                }
            }
        }
    }

    /// After `max_flow`: the nodes still reachable from `s` in the residual graph (the source side
    /// of a minimum cut).
    pub fn source_side(&self, s: usize) -> Vec<bool> {
        self.levels(s).iter().map(|&l| l != u32::MAX).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_network_cut_value_and_sides() {
        // s=0, t=5; the minimum cut is {1->3 (12), 4->3 (7), 4->5 (4)} = 23
        let mut g = FlowNet::new(6);
        for (a, b, c) in [
            (0, 1, 16),
            (0, 2, 13),
            (1, 2, 10),
            (2, 1, 4),
            (1, 3, 12),
            (3, 2, 9),
            (2, 4, 14),
            (4, 3, 7),
            (3, 5, 20),
            (4, 5, 4),
        ] {
            g.add_edge(a, b, c);
        }
        assert_eq!(g.max_flow(0, 5), 23);
        let side = g.source_side(0);
        assert_eq!(side, vec![true, true, true, false, true, false]);
    }
}

//! Missing privileges, named: what the PostgreSQL source and sink report when their role lacks
//! a privilege, found before any data moves (`sources/postgres/privileges.rs`,
//! `sinks/postgres/privileges.rs`). Each is named with its object and the statement an
//! administrator runs to grant it; all of them at once, so one round of grants is enough.

/// The privileges a role needs and does not have.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Missing {
    role: String,
    /// (what is missing, the statement that grants it).
    items: Vec<(String, String)>,
}

impl Missing {
    /// Nothing missing yet, for `role`.
    pub(crate) fn of(role: &str) -> Self {
        Self {
            role: role.to_owned(),
            items: Vec::new(),
        }
    }

    /// `what` is missing (`SELECT on table public.books`); `grant` gives it.
    pub(crate) fn add(&mut self, what: String, grant: String) {
        self.items.push((what, grant));
    }

    /// `None` when nothing is missing, else the report: who lacks what for `needed_by`, and
    /// what was not done (`nothing was read`).
    pub(crate) fn report(&self, needed_by: &str, not_done: &str) -> Option<String> {
        if self.items.is_empty() {
            return None;
        }
        let lines: Vec<String> = self
            .items
            .iter()
            .map(|(what, grant)| format!("\n  - {what} (an administrator runs: {grant})"))
            .collect();
        Some(format!(
            "role `{}` lacks what {needed_by} needs, {not_done}:{}",
            self.role,
            lines.concat()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_missing_privilege_is_named_with_its_grant() {
        let mut missing = Missing::of("reader");
        assert_eq!(missing.report("the source", "nothing was read"), None);
        missing.add(
            "the REPLICATION attribute".into(),
            "ALTER ROLE reader REPLICATION".into(),
        );
        missing.add(
            "SELECT on table public.books".into(),
            "GRANT SELECT ON public.books TO reader".into(),
        );
        let message = missing.report("the source", "nothing was read").unwrap();
        assert_eq!(
            message,
            "role `reader` lacks what the source needs, nothing was read:\n  \
             - the REPLICATION attribute (an administrator runs: ALTER ROLE reader REPLICATION)\n  \
             - SELECT on table public.books (an administrator runs: GRANT SELECT ON public.books TO reader)"
        );
    }
}

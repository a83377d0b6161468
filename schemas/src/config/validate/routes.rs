//! Routes from projections to sinks: a sink must accept every family of write operations the
//! projection emits. The families come from the kinds' own declarations (see [`Families`]);
//! nothing here lists which kind goes with which.

use super::super::{PipelineFile, ProjectionConfig, SinkConfig};
use crate::write::OpFamily;

/// What each kind declares about the write operations it exchanges. The crates that own the
/// kinds answer (the `refract` binary asks `refract_projections::emits` and
/// `refract_connectors::registry::accepts`), so a new projection or sink kind brings its own
/// declaration and validation needs no change.
pub trait Families {
    /// The families a projection of this kind emits.
    fn emits(&self, projection: &ProjectionConfig) -> &'static [OpFamily];
    /// The families a sink of this kind accepts.
    fn accepts(&self, sink: &SinkConfig) -> &'static [OpFamily];
}

impl PipelineFile {
    /// Every route from a projection to a sink that cannot take all the projection emits, as
    /// `(field path, problem)` pairs naming both. Routes to unknown sinks are left to
    /// [`PipelineFile::validate`].
    pub fn route_problems(&self, families: &dyn Families) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        for (name, projection) in &self.projections {
            let emits = families.emits(projection);
            for (i, sink_name) in projection.sinks().iter().enumerate() {
                let Some(sink) = self.sinks.get(sink_name) else {
                    continue;
                };
                let accepts = families.accepts(sink);
                let refused: Vec<OpFamily> = emits
                    .iter()
                    .copied()
                    .filter(|f| !accepts.contains(f))
                    .collect();
                if refused.is_empty() {
                    continue;
                }
                problems.push((
                    format!("projections.{name}.sinks[{i}]"),
                    format!(
                        "projection `{name}` (kind `{}`) writes {}, which sink `{sink_name}` \
                         (kind `{}`) cannot take: it accepts {}",
                        projection.kind(),
                        OpFamily::sentence(&refused),
                        sink.kind(),
                        OpFamily::sentence(accepts),
                    ),
                ));
            }
        }
        problems
    }
}

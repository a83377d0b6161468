//! The recent troubles of a running pipeline, for the status page: a small ring of warnings and
//! errors (a sink retrying, a target or the source turning unhealthy) and one of the latest dead
//! letters with their reasons. The log keeps everything; these rings keep what an operator
//! opening the page needs first.

use std::collections::VecDeque;
use std::sync::Mutex;

use refract_connectors::dead_letter::Stage;
use serde::Serialize;

use super::status::lock;

/// How many warnings and errors the page lists: a screenful, newest first.
const RECENT_ERRORS: usize = 20;
/// How many dead letters the page lists with their reasons.
const RECENT_DEAD_LETTERS: usize = 10;
/// How much of a reason or message is kept: error texts quoting a whole row can be long.
const MAX_TEXT_CHARS: usize = 500;

/// How bad an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Level {
    /// Back to normal.
    Info,
    /// Retried or recovered by itself.
    Warning,
    /// Made the pipeline unhealthy.
    Error,
}

/// One warning or error.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Entry {
    /// When it last happened (milliseconds since the epoch).
    pub(crate) at_ms: i64,
    /// How bad.
    pub(crate) level: Level,
    /// What it concerns: `source`, or a sink's name.
    pub(crate) subject: String,
    /// What happened.
    pub(crate) message: String,
    /// How many times in a row it happened (a sink retrying the same error).
    pub(crate) count: u64,
}

/// One dead letter as the page lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Letter {
    /// When it was set aside (milliseconds since the epoch).
    pub(crate) at_ms: i64,
    /// The stage that rejected it (`decode`, `routing`, `projection`, `sink`).
    pub(crate) stage: &'static str,
    /// Where the input sits in its source.
    pub(crate) position: String,
    /// Why.
    pub(crate) reason: String,
}

/// The two rings, written by the runtime's tasks and read by the status page.
#[derive(Debug, Default)]
pub(crate) struct Journal {
    errors: Mutex<VecDeque<Entry>>,
    letters: Mutex<VecDeque<Letter>>,
}

impl Journal {
    /// Records a warning or an error about `subject`; the same message again right after only
    /// counts up (a sink retrying every few seconds fills no ring).
    pub(crate) fn note(&self, level: Level, subject: &str, message: &str) {
        let message = shortened(message);
        let at_ms = super::now_ms();
        let mut errors = lock(&self.errors);
        match errors.back_mut() {
            Some(last)
                if last.subject == subject && last.message == message && last.level == level =>
            {
                last.count += 1;
                last.at_ms = at_ms;
                return;
            }
            _ => {}
        }
        push_bounded(
            &mut errors,
            RECENT_ERRORS,
            Entry {
                at_ms,
                level,
                subject: subject.to_owned(),
                message,
                count: 1,
            },
        );
    }

    /// Records a dead letter.
    pub(crate) fn dead_letter(&self, stage: Stage, position: String, reason: &str) {
        let letter = Letter {
            at_ms: super::now_ms(),
            stage: super::metrics::stage_name(stage),
            position,
            reason: shortened(reason),
        };
        push_bounded(&mut lock(&self.letters), RECENT_DEAD_LETTERS, letter);
    }

    /// The recent warnings and errors, newest first.
    pub(crate) fn errors(&self) -> Vec<Entry> {
        lock(&self.errors).iter().rev().cloned().collect()
    }

    /// The latest dead letters, newest first.
    pub(crate) fn letters(&self) -> Vec<Letter> {
        lock(&self.letters).iter().rev().cloned().collect()
    }
}

/// Appends `item`, dropping the oldest past `capacity`.
fn push_bounded<T>(ring: &mut VecDeque<T>, capacity: usize, item: T) {
    if ring.len() == capacity {
        ring.pop_front();
    }
    ring.push_back(item);
}

/// `text` cut to [`MAX_TEXT_CHARS`] characters.
fn shortened(text: &str) -> String {
    match text.char_indices().nth(MAX_TEXT_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_error_counts_up_and_the_ring_keeps_the_newest() {
        let journal = Journal::default();
        journal.note(Level::Warning, "redis", "connection refused");
        journal.note(Level::Warning, "redis", "connection refused");
        let errors = journal.errors();
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].count, 2);
        for i in 0..RECENT_ERRORS + 5 {
            journal.note(Level::Error, "source", &format!("failure {i}"));
        }
        let errors = journal.errors();
        assert_eq!(errors.len(), RECENT_ERRORS);
        assert_eq!(errors[0].message, format!("failure {}", RECENT_ERRORS + 4));
        journal.dead_letter(
            Stage::Routing,
            "s@1".into(),
            &"x".repeat(2 * MAX_TEXT_CHARS),
        );
        assert_eq!(
            journal.letters()[0].reason.chars().count(),
            MAX_TEXT_CHARS + 1
        );
    }
}

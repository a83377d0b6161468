//! Kafka failures as [`SinkError`]s: what retrying can fix (brokers down, timeouts, leader
//! elections) and what it cannot (authentication, authorization, a message the broker refuses,
//! a topic that does not exist, bad settings), sorted by librdkafka's error codes.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::SinkError;

/// Error codes retrying cannot fix, with what the operator should do.
fn permanent(code: RDKafkaErrorCode) -> Option<&'static str> {
    use RDKafkaErrorCode as C;
    Some(match code {
        C::Authentication | C::SaslAuthenticationFailed | C::SSL => {
            "authentication failed: check `properties` (security.protocol, sasl.*, ssl.*)"
        }
        C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed => {
            "not authorized: grant the sink's principal WRITE (and DESCRIBE) on its topics and \
             IDEMPOTENT_WRITE on the cluster"
        }
        C::MessageSizeTooLarge | C::InvalidMessageSize => {
            "a message is larger than the broker or topic accepts: raise the topic's \
             max.message.bytes (and `properties.message.max.bytes`)"
        }
        C::UnknownTopic | C::UnknownTopicOrPartition => {
            "the topic does not exist and the brokers do not create topics: create it \
             (see docs/sinks/kafka.md, Topics)"
        }
        C::InvalidTopic => "the topic name is invalid",
        C::InvalidRecord | C::PolicyViolation => {
            "the broker refused a record (a keyless record, such as a truncate, in a compacted \
             topic, or a topic policy)"
        }
        C::InvalidRequiredAcks
        | C::InvalidConfig
        | C::InvalidArgument
        | C::UnsupportedVersion
        | C::UnsupportedCompressionType
        | C::UnsupportedFeature => "the brokers refuse the producer's settings",
        _ => return None,
    })
}

/// A Kafka failure of sink `sink` while doing `what`, classified.
pub(super) fn sink_error(sink: &str, what: &str, error: KafkaError) -> SinkError {
    // The error's own text holds the setting's value, which may be a password: name the key only.
    if let KafkaError::ClientConfig(_, description, key, _) = &error {
        return SinkError::Permanent {
            sink: sink.to_owned(),
            message: format!("{what}: the producer refuses setting `{key}`: {description}"),
            source: None,
        };
    }
    let hint = match &error {
        KafkaError::ClientCreation(_) => Some("the producer's settings are invalid"),
        other => other.rdkafka_error_code().and_then(permanent),
    };
    match hint {
        Some(hint) => SinkError::Permanent {
            sink: sink.to_owned(),
            message: format!("{what}: {hint}: {error}"),
            source: Some(Box::new(error)),
        },
        None => SinkError::Transient {
            sink: sink.to_owned(),
            message: format!("{what}: {error}"),
            source: Some(Box::new(error)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_sort_into_retryable_and_permanent() {
        use RDKafkaErrorCode as C;
        let cases = [
            (C::MessageTimedOut, true),
            (C::AllBrokersDown, true),
            (C::BrokerTransportFailure, true),
            (C::NotLeaderForPartition, true),
            (C::NotEnoughReplicas, true),
            (C::RequestTimedOut, true),
            (C::QueueFull, true),
            (C::TopicAuthorizationFailed, false),
            (C::SaslAuthenticationFailed, false),
            (C::MessageSizeTooLarge, false),
            (C::UnknownTopicOrPartition, false),
            (C::InvalidRecord, false),
        ];
        for (code, retryable) in cases {
            let e = sink_error("k", "delivery", KafkaError::MessageProduction(code));
            assert_eq!(e.is_retryable(), retryable, "{code:?}: {e}");
        }
        let e = sink_error(
            "k",
            "producer",
            KafkaError::ClientCreation("bad setting".into()),
        );
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("settings are invalid"), "{e}");
    }
}

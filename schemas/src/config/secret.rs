//! The configuration's secrets: passwords, tokens, keys, and URLs that may carry a password.
//!
//! Each is held in a type whose `Debug`, `Display` and `Serialize` never show it, so a config
//! printed by `{:?}` in a log line, a panic or an error message stays safe. The value is read
//! only through `expose()`, at the one place that hands it to a client library: a `grep expose`
//! lists every such place.

use std::borrow::Cow;
use std::fmt;

use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::mask_url;

/// What a hidden secret is shown as.
pub const REDACTED: &str = "***";

/// A password, token, key or any value a pass-through client setting may hide (Kafka
/// `properties`): shown as `***` everywhere.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The value itself, for the client library that needs it. Never format it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// A connection or object-store URL: shown with the password of its user-info and of a
/// `password=` query parameter replaced by `***` ([`mask_url`]).
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// The URL itself, password included, for the client library that connects with it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with its password hidden (what `Display` shows).
    pub fn masked(&self) -> String {
        mask_url(&self.0)
    }

    /// Whether the URL begins with `prefix` (a scheme such as `postgres://`).
    pub fn starts_with(&self, prefix: &str) -> bool {
        self.0.starts_with(prefix)
    }

    /// The URL without the `scheme://` prefix removed, when it has this scheme (`file`): a path,
    /// which holds no password.
    pub fn strip_scheme(&self, scheme: &str) -> Option<&str> {
        self.0.strip_prefix(scheme)?.strip_prefix("://")
    }
}

macro_rules! secret_text {
    ($name:ident, $show:expr) => {
        impl From<String> for $name {
            fn from(value: String) -> Self {
                Self(value)
            }
        }

        impl From<&str> for $name {
            fn from(value: &str) -> Self {
                Self(value.to_owned())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let show: fn(&$name) -> Cow<'_, str> = $show;
                write!(f, "{:?}", show(self))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let show: fn(&$name) -> Cow<'_, str> = $show;
                f.write_str(&show(self))
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let show: fn(&$name) -> Cow<'_, str> = $show;
                serializer.serialize_str(&show(self))
            }
        }

        /// A plain string in the pipeline file's JSON Schema.
        impl JsonSchema for $name {
            fn inline_schema() -> bool {
                true
            }

            fn schema_name() -> Cow<'static, str> {
                String::schema_name()
            }

            fn json_schema(generator: &mut SchemaGenerator) -> Schema {
                String::json_schema(generator)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                String::deserialize(deserializer).map(Self)
            }
        }
    };
}

secret_text!(Secret, |_| Cow::Borrowed(REDACTED));
secret_text!(SecretUrl, |url| Cow::Owned(url.masked()));

#[cfg(test)]
mod tests {
    use super::*;

    const SENTINEL: &str = "s3ntinel-pw";

    #[derive(Debug, Serialize, Deserialize)]
    struct Holder {
        url: SecretUrl,
        password: Secret,
    }

    #[test]
    fn debug_display_and_serialize_never_show_the_secret() {
        let holder: Holder = toml::from_str(&format!(
            "url = \"postgres://me:{SENTINEL}@db/app?password={SENTINEL}\"\npassword = \"{SENTINEL}\""
        ))
        .unwrap();
        let shown = [
            format!("{holder:?}"),
            format!("{holder:#?}"),
            format!("{} {}", holder.url, holder.password),
            serde_json::to_string(&holder).unwrap(),
        ];
        for text in shown {
            assert!(!text.contains(SENTINEL), "{text}");
            assert!(text.contains("postgres://me:***@db/app"), "{text}");
        }
        assert_eq!(holder.password.expose(), SENTINEL);
        assert!(holder.url.expose().contains(SENTINEL));
    }

    #[test]
    fn a_file_url_gives_its_path() {
        let url = SecretUrl::from("file:///var/out");
        assert_eq!(url.strip_scheme("file"), Some("/var/out"));
        assert_eq!(url.strip_scheme("s3"), None);
    }
}
